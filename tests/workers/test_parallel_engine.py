"""Engines over worker groups (real `ShardWorker` Ray actors, gloo on loopback) give what one shard gives.

One driver run (this file run as a script, in a child process so its private Ray instance never meets another
test's `ray.init`) serves every test here: it runs the same concurrent requests through the single-shard
in-process engine and through engines of each layout below, and reports tokens, logprobs, per-rank counters,
page accounting, host overhead and the start failures it provoked. The tests then check each part.

Workload: 5 requests of 90/23/41/5/64 prompt tokens, all in flight together, chunked prefill (64 tokens a step,
so the 90-token prompt takes two steps and prefills share steps with decodes), MSA block selection active
(prompts past 4 blocks of 16), greedy decoding with top-5 logprobs, one seeded sampled request, one request
asking for prompt logprobs. With dp = 2 the least-loaded assignment puts requests 0, 2, 4 on dp rank 0 and 1, 3
on dp rank 1; those finish after 3 tokens, so dp rank 1 is idle while dp rank 0 still works.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# name -> (tp, ep, dp); ep > tp with dp > 1 puts dp ranks in lockstep (idle ranks run empty forwards)
CASES = {
    "tp2": (2, 1, 1),
    "tp4-kv-replicated": (4, 1, 1),  # the tiny model has 2 KV heads: each is held by two tp ranks
    "tp2-ep2": (2, 2, 1),
    "tp4-ep4": (4, 4, 1),
    "dp2-ep2": (1, 2, 2),
    "tp2-dp2-ep4": (2, 4, 2),
    "tp2-ep2-capacity": (2, 2, 1),
    "dp2-ep2-capacity": (1, 2, 2),
}
RPC_CASES = {"tp2-ep2", "dp2-ep2"}  # steps as plain actor calls; the others through the compiled graph
# the capacity MoE dispatch (msa/moe.py): lockstep dp ranks exchange their step sizes in the runner first
CAPACITY_CASES = {"tp2-ep2-capacity", "dp2-ep2-capacity"}
PROMPT_LENS = (90, 23, 41, 5, 64)
MAX_TOKENS = (8, 3, 8, 3, 6)
TOL = 1e-4


# ---- the driver (child process) ------------------------------------------------------------------------------

def _requests():
    import random

    from workers.request import SamplingParams

    rng = random.Random(0)
    out = []
    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        prompt = [rng.randrange(3, 384) for _ in range(n)]
        if i == 4:  # sampled, seeded: its RNG lives on tp rank 0 of its dp rank across steps
            params = SamplingParams(temperature=0.8, seed=1234, max_tokens=m, ignore_eos=True, logprobs=5)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5,
                                    prompt_logprobs=3 if i == 1 else None)
        out.append((f"r{i}", prompt, params))
    return out


def _outputs(engine) -> dict:
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = {
                    "tokens": c.token_ids,
                    "logprobs": [{str(k): v for k, v in d.items()} for d in c.logprobs],
                    "prompt_logprobs": None if o.prompt_logprobs is None else
                    [None if d is None else {str(k): v for k, v in d.items()} for d in o.prompt_logprobs],
                }
    return done


def _decode_overhead_ms(engine) -> float:
    steps = [s for s in engine.pop_step_stats() if s.num_prefill_tokens == 0]
    vals = sorted(1e3 * s.host_overhead for s in steps)
    return vals[len(vals) // 2]


def _pages(engine) -> list[dict]:
    return [{"free": c.pages.num_free_pages, "total": c.pages.num_pages, "owners": len(c.pages.owners())}
            for c in engine.cores]


def _group_of(engine):
    return getattr(engine, "group", None) or engine.executor.group


def _expect_start_error(fn) -> dict:
    from workers.executor.ray_group import GroupStartError

    t = time.monotonic()
    try:
        fn()
    except GroupStartError as e:
        return {"error": str(e), "seconds": time.monotonic() - t}
    return {"error": None, "seconds": time.monotonic() - t}


def _failures(ckpt: str, engine_config, tmp: Path) -> dict:
    import shutil

    import ray

    from workers.config import ParallelConfig
    from workers.executor.ray_group import GroupOptions, WorkerGroup

    out = {}
    broken = tmp / "broken-ckpt"
    shutil.copytree(ckpt, broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()  # the index lists it; every rank's load fails
    out["bad_checkpoint"] = _expect_start_error(lambda: WorkerGroup(
        broken, engine_config=engine_config, parallel=ParallelConfig(tp=2),
        options=GroupOptions(num_cpus_per_shard=1, start_timeout_s=120)))
    out["unsatisfiable"] = _expect_start_error(lambda: WorkerGroup(
        ckpt, engine_config=engine_config, parallel=ParallelConfig(tp=2),
        options=GroupOptions(num_cpus_per_shard=3, placement_timeout_s=2)))
    out["placement_groups_left"] = sum(1 for pg in ray.util.placement_group_table().values()
                                       if pg["state"] != "REMOVED")
    return out


def _dead_rank(engine) -> dict:
    """Kill tp rank 1 of a running tp=2 engine: the health check and the next step both name it."""
    import ray

    from workers.executor import GroupError
    from workers.request import SamplingParams

    group = _group_of(engine)
    out = {"ping_before": group.ping()}
    ray.kill(group.actors[1])
    out["ping"] = None
    deadline = time.monotonic() + 20
    while out["ping"] is None and time.monotonic() < deadline:  # the kill lands asynchronously
        try:
            group.ping(timeout_s=5)
            time.sleep(0.1)
        except GroupError as e:
            out["ping"] = str(e)
    try:
        engine.add_request("after-kill", [5, 6, 7], SamplingParams(max_tokens=2))
        engine.step()
        out["step"] = None
    except GroupError as e:
        out["step"] = str(e)
    return out


def _through_async_engine(engine) -> dict:
    """The same requests streamed concurrently through `AsyncEngine` (the server's step thread) over a
    DPEngine; one client leaves its stream early (abort)."""
    import asyncio

    from workers.async_engine import AsyncEngine

    async def one(aeng, rid, prompt, params, leave_after=None):
        n, last = 0, None
        async for out in aeng.generate(f"async-{rid}", prompt, params):
            n, last = n + 1, out
            if leave_after is not None and n == leave_after:
                break
        c = last.outputs[0]
        return rid, {"tokens": c.token_ids, "logprobs": [{str(k): v for k, v in d.items()} for d in c.logprobs]}

    async def main():
        aeng = AsyncEngine(engine)
        try:
            reqs = _requests()
            tasks = [one(aeng, rid, prompt, params) for rid, prompt, params in reqs[:4]]
            tasks.append(one(aeng, "left", reqs[0][1], reqs[0][2], leave_after=2))
            done = dict(await asyncio.gather(*tasks))
            for _ in range(200):  # the abort of the stream left early lands between steps
                st = aeng.stats()
                if st.num_running == st.num_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            return done, aeng.stats()
        finally:
            await asyncio.to_thread(aeng.shutdown)

    done, st = asyncio.run(main())
    return {"outputs": done, "free": st.num_pages_free, "total": st.num_pages_total}


def drive(ckpt: str, tmp: Path) -> dict:
    import ray
    import torch

    from workers.config import EngineConfig, ParallelConfig
    from workers.engine import Engine, make_engine
    from workers.executor.ray_group import GroupOptions
    from workers.llm import LLM

    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=4, object_store_memory=256 * 2**20, include_dashboard=False,
             log_to_driver=bool(os.environ.get("M3SERVE_TEST_RAY_LOGS")), configure_logging=False)
    engine_fields = {"num_pages": 64, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    engine_config = EngineConfig(**engine_fields)
    result: dict = {"cases": {}}
    try:
        single = Engine(ckpt, engine_config=engine_config)
        result["single"] = _outputs(single)
        result["single_overhead_ms"] = _decode_overhead_ms(single)
        single.shutdown()
        # one shard in an actor: the per-step cost of a Ray round trip alone, to compare tp=2 with
        ray_one = Engine(ckpt, engine_config=engine_config, executor="ray")
        _outputs(ray_one)
        result["ray_tp1_overhead_ms"] = _decode_overhead_ms(ray_one)
        ray_one.shutdown()
        for name, (tp, ep, dp) in CASES.items():
            t = time.monotonic()
            options = GroupOptions(num_cpus_per_shard=1, placement_timeout_s=120,
                                   dispatch="rpc" if name in RPC_CASES else "compiled",
                                   moe_dispatch="capacity" if name in CAPACITY_CASES else "alltoall")
            if name == "tp2":  # the offline API path
                llm = LLM(ckpt, tp=tp, ep=ep, dp=dp, executor=options, **engine_fields)
                engine = llm.engine
            else:
                engine = make_engine(ckpt, engine_config=engine_config,
                                     parallel=ParallelConfig(tp=tp, ep=ep, dp=dp), executor=options)
            start_s = time.monotonic() - t
            case = {"start_s": start_s, "type": type(engine).__name__, "assignment": None,
                    "dispatch": options.dispatch}
            outs = _outputs(engine) if dp == 1 else _outputs_recording_ranks(engine, case)
            case.update(outputs=outs, overhead_ms=_decode_overhead_ms(engine), pages=_pages(engine),
                        counters=_group_of(engine).call("counters"), steps=engine.num_steps,
                        unfinished=engine.has_unfinished())
            if name == "tp2":
                case["dead_rank"] = _dead_rank(engine)
            if name == "dp2-ep2":
                case["async"] = _through_async_engine(engine)  # shuts the engine down
            engine.shutdown()
            result["cases"][name] = case
        result["failures"] = _failures(ckpt, engine_config, tmp)
    finally:
        ray.shutdown()
    return result


def _outputs_recording_ranks(engine, case: dict) -> dict:
    """`_outputs` for a DPEngine, noting each request's dp rank as it is added."""
    add = engine.add_request
    case["assignment"] = {}

    def add_and_record(rid, *a, **kw):
        add(rid, *a, **kw)
        case["assignment"][rid] = engine.dp_rank_of(rid)

    engine.add_request = add_and_record
    try:
        return _outputs(engine)
    finally:
        del engine.add_request


# ---- the tests (parent process) ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel-engine")
    out = tmp / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, str(tiny_ckpt), str(tmp), str(out)], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2], env=env)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-6000:]
    res = json.loads(out.read_text())
    res["wall_s"] = time.monotonic() - t
    return res


def _assert_same(ref: dict, got: dict, where: str) -> None:
    assert got["tokens"] == ref["tokens"], f"{where}: tokens {got['tokens']} != {ref['tokens']}"
    for j, (a, b) in enumerate(zip(ref["logprobs"], got["logprobs"], strict=True)):
        assert set(a) == set(b), f"{where} token {j}: top ids {sorted(b)} != {sorted(a)}"
        worst = max(abs(a[k] - b[k]) for k in a)
        assert worst <= TOL, f"{where} token {j}: logprob off by {worst:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_engine_matches_one_shard(run, case):
    ref, got = run["single"], run["cases"][case]
    assert set(got["outputs"]) == set(ref) == {f"r{i}" for i in range(len(PROMPT_LENS))}
    for rid in ref:
        _assert_same(ref[rid], got["outputs"][rid], f"{case}/{rid}")
        assert len(got["outputs"][rid]["tokens"]) == MAX_TOKENS[int(rid[1:])]
    a, b = ref["r1"]["prompt_logprobs"], got["outputs"]["r1"]["prompt_logprobs"]
    assert a is not None and len(a) == len(b) == PROMPT_LENS[1]
    for pa, pb in zip(a[1:], b[1:]):
        assert set(pa) == set(pb) and max(abs(pa[k] - pb[k]) for k in pa) <= TOL
    tp, ep, dp = CASES[case]
    assert got["type"] == ("DPEngine" if dp > 1 else "Engine")


@pytest.mark.parametrize("case", list(CASES))
def test_every_page_free_after(run, case):
    got = run["cases"][case]
    assert not got["unfinished"]
    assert len(got["pages"]) == CASES[case][2]
    for p in got["pages"]:
        assert p["free"] == p["total"] == 64 and p["owners"] == 0


@pytest.mark.parametrize("case", [c for c, (tp, ep, dp) in CASES.items() if dp == 1])
def test_one_call_per_rank_per_step(run, case):
    got = run["cases"][case]
    tp, ep, dp = CASES[case]
    assert len(got["counters"]) == tp * dp
    assert [c["calls"] for c in got["counters"]] == [got["steps"]] * (tp * dp)


@pytest.mark.parametrize("case", [c for c, (tp, ep, dp) in CASES.items() if dp > 1])
def test_idle_dp_rank_runs_empty_forwards(run, case):
    """dp rank 1 (requests r1, r3: 3 tokens each) finishes first; while dp rank 0 still works, every tp rank of
    dp rank 1 runs empty forwards (ep spans both dp ranks), and dp rank 0's never idle."""
    got = run["cases"][case]
    tp, ep, dp = CASES[case]
    assert got["assignment"] == {"r0": 0, "r1": 1, "r2": 0, "r3": 1, "r4": 0}
    counters = got["counters"]
    rank0, rank1 = counters[:tp], counters[tp:]
    assert all(c["idle_forwards"] == 0 for c in rank0)
    idle = {c["idle_forwards"] for c in rank1}
    assert len(idle) == 1 and idle.pop() >= 3  # the same count on each tp rank of the idle dp rank
    # every rank joined every group step (lockstep), busy or idle
    assert len({c["calls"] for c in counters}) == 1 and counters[0]["calls"] == got["steps"]


def test_dp_engine_streams_through_async_engine(run):
    a = run["cases"]["dp2-ep2"]["async"]
    ref = run["single"]
    for rid in ("r0", "r1", "r2", "r3"):
        _assert_same(ref[rid], a["outputs"][rid], f"async/{rid}")
    assert len(a["outputs"]["left"]["tokens"]) == 2  # the client that left early got what it had read
    assert a["free"] == a["total"] == 2 * 64  # both dp ranks' pools, every page back (abort included)


def test_dead_rank_is_named_by_ping_and_step(run):
    d = run["cases"]["tp2"]["dead_rank"]
    print(f"\nping: {d['ping']}\nstep: {d['step']}")
    assert d["ping_before"] == ["ok", "ok"]
    assert d["ping"] is not None and d["ping"].startswith("rank 1"), d["ping"]
    assert d["step"] is not None and "rank" in d["step"] and "tp=2" in d["step"], d["step"]


def test_start_failures_are_clean_errors(run):
    f = run["failures"]
    bad = f["bad_checkpoint"]
    assert bad["error"] is not None and bad["error"].startswith("rank "), bad
    assert "failed to start" in bad["error"] and "WeightLoadError" in bad["error"], bad
    assert "model-00002-of-00002.safetensors" in bad["error"], bad
    assert bad["seconds"] < 60  # the first failing rank ends the start; nobody waits for the timeout
    un = f["unsatisfiable"]
    assert un["error"] is not None and un["error"].startswith("placement: 2 shards of {'CPU': 3.0}"), un
    assert "not granted within 2 s" in un["error"] and un["seconds"] < 30, un
    assert f["placement_groups_left"] == 0  # every failed start gave its placement back


def test_report_host_overhead(run):
    """Per decode step, outside the forward: in-process, one actor, and the groups (printed for the report)."""
    lines = [f"single in-process {run['single_overhead_ms']:.2f} ms", f"ray tp1 {run['ray_tp1_overhead_ms']:.2f} ms"]
    for name, c in run["cases"].items():
        lines.append(f"{name} ({c['dispatch']}) {c['overhead_ms']:.2f} ms (start {c['start_s']:.1f} s)")
    print("\n" + "\n".join(lines) + f"\ndriver wall {run['wall_s']:.1f} s")
    # a group step is one round of Ray calls, not a per-rank sequence: tp2 stays within a few actor round trips
    assert run["cases"]["tp2"]["overhead_ms"] < 5 * run["ray_tp1_overhead_ms"] + 5


if __name__ == "__main__":
    _ckpt, _tmp, _out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    _out.write_text(json.dumps(drive(_ckpt, _tmp)))
