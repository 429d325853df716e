"""Disaggregation across parallel layouts: prefill and decode engines whose worker groups differ (issue 7).

One driver run (this file as a script, in a child process with its own Ray instance on loopback) builds a
unified single-shard engine (the reference), an in-process prefill and decode engine (tp=1), a prefill engine
over a tp=2 worker group, a decode engine over a dp=2 ep=2 worker group (`DPEngine`: one receiving tp group
per dp rank; the experts split over both dp ranks, so they step in lockstep) and a prefill engine over a dp=2
ep=2 worker group (one sending tp group per dp rank, also in lockstep), all real `ShardWorker` actors with
gloo pairs between the shards. Each shard hosts its own `TransferAgent`; the engine fans its transfer calls out
through `GroupTransferAgent`.

Cases (8 requests in flight together, prompts of 5 to 150 tokens, most past the 64 where the tiny model's
sparse layers start selecting blocks; greedy, top-5 logprobs):
  tp2 -> tp1: prefill shard 0 sends KV head 0 and the index-K, shard 1 head 1, into one decode shard;
  tp1 -> dp2: each request lands on the dp rank that admitted it (least loaded with room);
  tp2 -> dp2: both at once;
  dp2 -> tp1: each request is placed on the least loaded prefill dp rank before the decode side admits it under
              that rank's sub-group; its KV goes from that rank's shard (the decode shard listens per prefill dp
              rank);
  dp2 -> dp2: every (prefill dp rank, decode dp rank) pair exists; a request goes from its placed prefill rank
              into its admitting decode rank.
Each must give the unified engine's tokens and top-5 logprobs (1e-4), one transfer record per request with the
exact bytes, and leave no page and no transfer bookkeeping on any engine core or shard. Also: a refused
transfer from the tp2 group (both of its shards' headers), and a client abort on a dp rank after the KV landed.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

LENGTHS = [5, 17, 33, 64, 65, 90, 120, 150]
MAX_TOKENS = [6, 4, 8, 1, 7, 5, 8, 3]
TOL = 1e-4
# tiny model, per page: 16 tokens x 4 B x (4 layers x K+V x 2 KV heads x 32 dims + index-K of 3 sparse layers x 32)
PER_PAGE = 16 * 4 * (4 * 2 * 2 * 32 + 3 * 32)
CASES = {"tp2->tp1": ("prefill_tp2", "decode_tp1"), "tp1->dp2": ("prefill_tp1", "decode_dp2"),
         "tp2->dp2": ("prefill_tp2", "decode_dp2"), "dp2->tp1": ("prefill_dp2", "decode_tp1"),
         "dp2->dp2": ("prefill_dp2", "decode_dp2")}
LAYOUT = {"tp1": (1, 1), "tp2": (2, 1), "dp2": (1, 2)}  # engine name suffix -> (tp, dp)


# ---- the driver (child process) ------------------------------------------------------------------------------

def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]


def _params():
    from workers.request import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=k, logprobs=5, ignore_eos=True) for k in MAX_TOKENS]


def _lp(dicts) -> list[dict[str, float]]:
    return [{str(k): v for k, v in d.items()} for d in dicts]


def _place(prefill, p_group: str, rid: str) -> tuple[str, int | None]:
    """(the group the decode side admits the request under, its prefill dp rank): a prefill with attention DP
    places the request on a dp rank first, and the decode side expects that rank's shards (the router's part)."""
    from workers.dp import DPEngine
    from workers.kv.agent import TransferAgent

    if isinstance(prefill, DPEngine):
        q = prefill.place_request(rid)
        return TransferAgent.dp_group(p_group, q), q
    return p_group, None


def _handoff_group(decode, d_group: str, rid: str) -> str:
    """Where the prefill sends a request: the decode group, or with attention DP its admitting dp rank's."""
    from workers.dp import DPEngine
    from workers.kv.agent import TransferAgent

    if isinstance(decode, DPEngine):
        return TransferAgent.dp_group(d_group, decode.dp_rank_of(rid))
    return d_group


def _drive(prefill, decode, until, timeout: float = 90.0, on_first=None) -> dict:
    from tests.workers.disagg_helpers import drive_pair  # also when this file runs as the driver script

    return drive_pair(prefill, decode, until, timeout=timeout, on_first=on_first)


def _leftovers(engine) -> dict:
    """Pages held by each engine core, and transfer bookkeeping left on each shard."""
    cores = engine.cores
    out = {"pages_held": [c.pages.num_pages - c.pages.num_free_pages for c in cores],
           "owners": [len(c.pages.owners()) for c in cores], "unfinished": engine.has_unfinished(),
           "shard_transfer_ids": []}
    for agent in engine.agents:
        ids = agent.transfer_ids()
        out["shard_transfer_ids"] += ids if ids and isinstance(ids[0], list) else [ids]
    return out


def _run_case(engines: dict, prefill_name: str, decode_name: str, groups: dict, tag: str) -> dict:
    prefill, decode = engines[prefill_name], engines[decode_name]
    p_group, d_group = groups[(prefill_name, decode_name)]
    ids = [f"{tag}-{i}" for i in range(len(LENGTHS))]
    assignment, placement = {}, {}
    t0 = time.monotonic()
    for rid, prompt, sp in zip(ids, _prompts(), _params()):
        admit_group, placement[rid] = _place(prefill, p_group, rid)
        if sp.max_tokens == 1:  # the first token ends it: prefill alone answers, nothing reserved on decode
            prefill.add_request(rid, prompt, sp, handoff_to=d_group)
            continue
        assert decode.admit_remote(rid, prompt, sp, group=admit_group) is not None
        if hasattr(decode, "dp_rank_of"):
            assignment[rid] = decode.dp_rank_of(rid)
        prefill.add_request(rid, prompt, sp, handoff_to=_handoff_group(decode, d_group, rid))
    handed = [rid for rid, k in zip(ids, MAX_TOKENS) if k > 1]
    st = _drive(prefill, decode, lambda s: set(s["out"]) >= set(handed) and len(s["outcomes"]) == len(handed))
    seconds = time.monotonic() - t0
    outputs = {}
    for i, rid in enumerate(ids):
        first = st["first"][rid].outputs[0]
        last = st["out"][rid].outputs[0] if rid in st["out"] else first
        outputs[str(i)] = {"tokens": last.token_ids, "text": last.text, "finish_reason": last.finish_reason,
                           "first_token": first.token_ids, "logprobs": _lp(first.logprobs[:1] + last.logprobs[1:])}
    _settle(prefill, decode)
    # per prefill dp rank: which rank's shards sent each request
    stats = [(q, s) for q, kv in enumerate(prefill.connectors) for s in kv.pop_transfer_stats()]
    return {"outputs": outputs, "outcomes": {r: list(v) for r, v in st["outcomes"].items()},
            "failures": st["failures"], "assignment": assignment, "placement": placement, "seconds": seconds,
            "stats": [{"request_id": s.request_id, "num_bytes": s.num_bytes, "seconds": s.seconds, "ok": s.ok,
                       "sent_from": q} for q, s in stats],
            "prefill": _leftovers(prefill), "decode": _leftovers(decode)}


def _settle(*engines, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(e.has_unfinished() for e in engines) and time.monotonic() < deadline:
        for e in engines:
            if e.has_unfinished():
                e.step()
        time.sleep(0.005)


def _refused_from_tp2(engines: dict, groups: dict) -> dict:
    """The tp2 prefill group's headers are corrupted on both shards: the decode shard refuses both, both sides
    fail the request and free its pages; the pairs stay usable (the next request goes through)."""
    from workers.request import SamplingParams
    from workers.testing import set_transfer_faults

    prefill, decode = engines["prefill_tp2"], engines["decode_tp1"]
    p_group, d_group = groups[("prefill_tp2", "decode_tp1")]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = _prompts()[5]
    set_transfer_faults(prefill, {"bad": "corrupt_header"})
    decode.admit_remote("bad", prompt, sp, group=p_group)
    prefill.add_request("bad", prompt, sp, handoff_to=d_group)
    st = _drive(prefill, decode, lambda s: "bad" in s["outcomes"] and "bad" in s["failures"])
    set_transfer_faults(prefill, {})
    out = {"outcome": list(st["outcomes"]["bad"]), "failure": st["failures"]["bad"],
           "broken": [prefill.kv_broken(d_group), decode.kv_broken(p_group)]}
    decode.admit_remote("good", prompt, sp, group=p_group)
    prefill.add_request("good", prompt, sp, handoff_to=d_group)
    st = _drive(prefill, decode, lambda s: "good" in s["out"] and "good" in s["outcomes"])
    out["after"] = st["out"]["good"].outputs[0].token_ids
    out["after_outcome"] = list(st["outcomes"]["good"])
    _settle(prefill, decode)
    prefill.pop_transfer_stats()
    out["prefill"], out["decode"] = _leftovers(prefill), _leftovers(decode)
    return out


def _abort_on_dp_rank(engines: dict, groups: dict) -> dict:
    """A request whose KV landed on a decode dp rank, then the client leaves before decode starts: the abort
    reaches that dp rank and frees its pages; a request admitted but never prefilled is aborted too."""
    from workers.request import SamplingParams

    prefill, decode = engines["prefill_tp1"], engines["decode_dp2"]
    p_group, d_group = groups[("prefill_tp1", "decode_dp2")]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = _prompts()[6]
    decode.admit_remote("never", prompt, sp, group=p_group)  # least loaded: dp rank 0
    decode.admit_remote("left", prompt, sp, group=p_group)  # dp rank 1
    ranks = {"never": decode.dp_rank_of("never"), "left": decode.dp_rank_of("left")}
    prefill.add_request("left", prompt, sp, handoff_to=_handoff_group(decode, d_group, "left"))
    st = _drive(prefill, decode, lambda s: "left" in s["outcomes"], on_first=lambda o: False)
    held = _leftovers(decode)["pages_held"]
    aborted = [decode.abort_request("never"), decode.abort_request("left")]
    _settle(prefill, decode)
    prefill.pop_transfer_stats()
    return {"ranks": ranks, "outcome": list(st["outcomes"]["left"]), "held_before_abort": held,
            "aborted": aborted, "prefill": _leftovers(prefill), "decode": _leftovers(decode)}


def _prefill_dp_edges(engines: dict, groups: dict) -> dict:
    """A prefill dp engine refuses a hand-off it did not place (the decode side could not know which rank's
    shards send it); a placement whose admission failed is let go by an abort; an abort after the KV left
    reaches the core that sent it. Nothing is held afterwards."""
    from workers.request import SamplingParams

    prefill, decode = engines["prefill_dp2"], engines["decode_tp1"]
    p_group, d_group = groups[("prefill_dp2", "decode_tp1")]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = _prompts()[5]
    out: dict = {}
    try:
        prefill.add_request("unplaced", prompt, sp, handoff_to=d_group)
    except ValueError as e:
        out["unplaced"] = str(e)
    q = prefill.place_request("gone")
    out["placed_then_aborted"] = [q, prefill.dp_rank_of("gone"), prefill.abort_request("gone"),
                                  prefill.dp_rank_of("gone")]
    admit_group, q = _place(prefill, p_group, "left")
    decode.admit_remote("left", prompt, sp, group=admit_group)
    prefill.add_request("left", prompt, sp, handoff_to=d_group)
    _drive(prefill, decode, lambda s: "left" in s["first"], on_first=lambda o: False)
    out["owner_after_first_token"] = [q, prefill.dp_rank_of("left")]
    out["pending_after_first_token"] = prefill.pending_prefill_tokens()  # past its prompt: weighs nothing
    out["aborted"] = [prefill.abort_request("left"), decode.abort_request("left")]
    _settle(prefill, decode)
    prefill.pop_transfer_stats()
    prefill.pop_transfer_outcomes()
    decode.pop_failures()
    out["prefill"], out["decode"] = _leftovers(prefill), _leftovers(decode)
    return out


def _prefill_dp_token_placement(engines: dict) -> dict:
    """Prefill dp placement weighs the prompt tokens still to prefill, not requests: after a 150-token prompt,
    two 5-token ones both go to the other rank (counting requests, the second would join the long one). Held
    placements weigh their `num_tokens` (1 unsaid), added requests their prompt tokens not computed yet: after
    one step (128-token budget) the long prompt has 22 left and the short ones, decoding now, none."""
    from workers.request import SamplingParams

    prefill = engines["prefill_dp2"]
    rng = random.Random(17)  # prompts no earlier case ran: no prefix-cache hit shortens them
    long, short_a, short_b = ([rng.randrange(3, 384) for _ in range(n)] for n in (150, 5, 5))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = {"before": prefill.pending_prefill_tokens()}
    prompts = {"long": long, "short-a": short_a, "short-b": short_b}
    out["ranks"] = [prefill.place_request(rid, len(prompt)) for rid, prompt in prompts.items()]
    out["held"] = prefill.pending_prefill_tokens()
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, sp)
    out["owned"] = prefill.pending_prefill_tokens()
    out["unsaid"] = prefill.place_request("unsaid")
    out["with_unsaid"] = prefill.pending_prefill_tokens()
    prefill.step()
    out["after_step"] = prefill.pending_prefill_tokens()
    out["owners_after_step"] = [prefill.dp_rank_of(rid) for rid in prompts]
    out["aborted"] = [prefill.abort_request(rid) for rid in (*prompts, "unsaid")]
    out["after_abort"] = prefill.pending_prefill_tokens()
    out["prefill"] = _leftovers(prefill)
    return out


def _kv_step_round_trip_ms(engine, n: int = 30) -> float:
    """What one KV-only step of a tp2 group costs (both shards run the commands and answer in parallel; it
    replaced the transfer poll): median ms."""
    from workers.batch import StepBatch
    from workers.kv.commands import KVCommands

    batch = StepBatch(input_ids=[], chunks=[], sample_chunks=[], rows=[], released_seq_ids=[],
                      kv=KVCommands(watch=("nothing",)))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        result = engine.executor.execute(batch)
        times.append(1e3 * (time.perf_counter() - t))
        assert result.kv.results["nothing"].settled  # unknown on both shards: reported, combined
    return sorted(times)[n // 2]


def _full_dp_pool(engines: dict, groups: dict) -> dict:
    """No dp rank has room: the admission is refused (None) and nothing is reserved; with the pages back the
    same admission succeeds."""
    from workers.request import SamplingParams
    from workers.testing import hold_pages

    decode = engines["decode_dp2"]
    p_group, _d_group = groups[("prefill_tp1", "decode_dp2")]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = _prompts()[7]  # 150 tokens = 10 pages
    free = decode.stats().num_pages_free
    hold_pages(decode, free - 9)  # dp rank 0's pool taken whole, then all but 9 of dp rank 1's
    out = {"free_each": [c.pages.num_free_pages for c in decode.cores],
           "refused": decode.admit_remote("full", prompt, sp, group=p_group) is None,
           "owner": decode.dp_rank_of("full")}
    hold_pages(decode, 0)
    out["admitted"] = decode.admit_remote("full", prompt, sp, group=p_group) is not None
    out["aborted"] = decode.abort_request("full")
    _settle(decode)
    out["decode"] = _leftovers(decode)
    return out


def drive(ckpt: str) -> dict:
    import ray
    import torch

    from workers.config import EngineConfig, ParallelConfig
    from workers.engine import Engine, make_engine
    from workers.executor.ray_group import GroupOptions
    from workers.kv.config import TransferConfig

    torch.set_num_threads(1)
    t_start = time.monotonic()
    # logical CPUs: one per shard of the three worker groups (the box has 2 cores; the groups take turns)
    ray.init(address="local", num_cpus=6, object_store_memory=256 * 2**20, include_dashboard=False,
             log_to_driver=bool(os.environ.get("M3SERVE_TEST_RAY_LOGS")), configure_logging=False,
             _node_ip_address="127.0.0.1")
    ec = EngineConfig(max_model_len=256, num_pages=64, max_num_batched_tokens=128, max_num_seqs=16)
    cfg = TransferConfig(timeout_s=5.0, receive_timeout_s=60.0, lease_s=60.0)
    result: dict = {"cases": {}}
    engines: dict = {}
    try:
        unified = Engine(ckpt, engine_config=ec)
        for i, (p, sp) in enumerate(zip(_prompts(), _params())):
            unified.add_request(str(i), p, sp)
        ref = {}
        while unified.has_unfinished():
            for o in unified.step():
                if o.finished:
                    c = o.outputs[0]
                    ref[o.request_id] = {"tokens": c.token_ids, "text": c.text, "logprobs": _lp(c.logprobs)}
        result["unified"] = ref
        unified.shutdown()

        t = time.monotonic()
        engines["prefill_tp1"] = Engine(ckpt, engine_config=ec, role="prefill", transfer=cfg)
        engines["decode_tp1"] = Engine(ckpt, engine_config=ec, role="decode", transfer=cfg)
        # the tp2 group steps through its compiled graph (transfer calls run beside it on each actor's own
        # thread); the dp2 group by plain calls (transfer calls queue between steps)
        engines["prefill_tp2"] = Engine(ckpt, engine_config=ec, parallel=ParallelConfig(tp=2), role="prefill",
                                        transfer=cfg, executor=GroupOptions(num_cpus_per_shard=1))
        # ep=2 spans both dp ranks: they step in lockstep, a dp rank whose requests still wait for their KV
        # runs empty forwards beside the other's decodes
        engines["decode_dp2"] = make_engine(ckpt, engine_config=ec, parallel=ParallelConfig(dp=2, ep=2),
                                            role="decode", transfer=cfg, executor=GroupOptions(num_cpus_per_shard=1, dispatch="rpc"))
        # the prefill side in lockstep too, through its compiled graph: a dp rank whose prompts are done runs
        # empty forwards while the other still prefills
        engines["prefill_dp2"] = make_engine(ckpt, engine_config=ec, parallel=ParallelConfig(dp=2, ep=2),
                                             role="prefill", transfer=cfg, executor=GroupOptions(num_cpus_per_shard=1))
        result["start_s"] = time.monotonic() - t

        # pairs, as the router opens them: decode listens (one address per route into its shards), prefill
        # connects; names are the other side's replica
        t = time.monotonic()
        groups = {}
        for p_name, d_name in CASES.values():
            p_group, d_group = f"{p_name}#0", f"{d_name}#0"
            p_tp, p_dp = LAYOUT[p_name[-3:]]
            listened = engines[d_name].kv_listen(p_group, p_tp, p_dp)  # per prefill dp rank when p_dp > 1
            engines[p_name].kv_connect(d_group, listened)
            engines[p_name].kv_wait_ready(30, d_group)
            engines[d_name].kv_wait_ready(30, p_group)
            groups[(p_name, d_name)] = (p_group, d_group)
            result.setdefault("listened", {})[f"{p_name}->{d_name}"] = [r for r, _addr in listened]
        result["pairs_s"] = time.monotonic() - t

        for tag, (p_name, d_name) in CASES.items():
            result["cases"][tag] = _run_case(engines, p_name, d_name, groups, tag)
        result["prefill_dp2_counters"] = engines["prefill_dp2"].group.call("counters")
        result["prefill_dp2_steps"] = engines["prefill_dp2"].num_steps
        result["prefill_dp_edges"] = _prefill_dp_edges(engines, groups)
        t = time.monotonic()
        result["prefill_dp_tokens"] = _prefill_dp_token_placement(engines)
        result["prefill_dp_tokens"]["seconds"] = time.monotonic() - t
        result["poll_ms"] = _kv_step_round_trip_ms(engines["prefill_tp2"])
        result["refused"] = _refused_from_tp2(engines, groups)
        result["abort_dp"] = _abort_on_dp_rank(engines, groups)
        result["full_dp"] = _full_dp_pool(engines, groups)
    finally:
        for e in engines.values():
            try:
                e.shutdown()
            except Exception as exc:  # report, but keep shutting the others down
                result.setdefault("shutdown_errors", []).append(repr(exc))
        ray.shutdown()
    result["driver_s"] = time.monotonic() - t_start
    return result


# ---- the tests (parent process) ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("disagg-parallel") / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, str(tiny_ckpt), str(out)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[2], env=env)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-8000:]
    res = json.loads(out.read_text())
    res["wall_s"] = time.monotonic() - t
    return res


def _assert_no_leftovers(side: dict, where: str) -> None:
    assert not side["unfinished"], f"{where}: requests left"
    assert set(side["pages_held"]) == {0} and set(side["owners"]) == {0}, f"{where}: pages held {side}"
    assert side["shard_transfer_ids"] and all(ids == [] for ids in side["shard_transfer_ids"]), \
        f"{where}: transfer bookkeeping left {side['shard_transfer_ids']}"


@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_layouts_equal_unified(run, case):
    got, ref = run["cases"][case], run["unified"]
    assert all(ok for ok, _why in got["outcomes"].values()) and not got["failures"], (got["outcomes"],
                                                                                     got["failures"])
    assert len(got["outcomes"]) == sum(k > 1 for k in MAX_TOKENS)
    for i, n in enumerate(LENGTHS):
        w, g = ref[str(i)], got["outputs"][str(i)]
        where = f"{case} request {i} (prompt {n})"
        assert g["first_token"] == w["tokens"][:1], where
        assert g["tokens"] == w["tokens"] and len(g["tokens"]) == MAX_TOKENS[i], where
        assert g["text"] == w["text"] and g["finish_reason"] == "length", where
        for j, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"], strict=True)):
            assert a.keys() == b.keys(), f"{where} token {j}: top-5 ids {sorted(a)} != {sorted(b)}"
            worst = max(abs(a[k] - b[k]) for k in a)
            assert worst <= TOL, f"{where} token {j}: logprob off by {worst:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_every_page_and_transfer_freed_on_both_sides(run, case):
    got = run["cases"][case]
    p_name, d_name = CASES[case]
    _assert_no_leftovers(got["prefill"], f"{case} {p_name}")
    _assert_no_leftovers(got["decode"], f"{case} {d_name}")
    # one transfer-id list per shard: 2 for a tp2 group or for dp2's two tp groups, 1 in-process
    assert len(got["prefill"]["shard_transfer_ids"]) == (2 if p_name.endswith(("tp2", "dp2")) else 1)
    assert len(got["decode"]["shard_transfer_ids"]) == (2 if d_name.endswith("dp2") else 1)


@pytest.mark.parametrize("case", list(CASES))
def test_one_transfer_record_per_request_with_exact_bytes(run, case):
    """The tp2 prefill's two shards each send part of the heads; their records add up to one per request
    carrying every byte of the request's pages (what an in-process single shard reports)."""
    got = run["cases"][case]
    want = {f"{case}-{i}": -(-n // 16) * PER_PAGE for i, (n, k) in enumerate(zip(LENGTHS, MAX_TOKENS)) if k > 1}
    assert {s["request_id"]: s["num_bytes"] for s in got["stats"]} == want
    assert len(got["stats"]) == len(want) and all(s["ok"] and s["seconds"] > 0 for s in got["stats"])


def test_routes_follow_plan_routes(run):
    """tp2 -> tp1: shard 0 sends KV head 0 with the index-K, shard 1 head 1; into dp2 every dp rank gets its
    own routes (tagged with the dp rank)."""
    lst = run["listened"]
    assert [(r["src"], r["dst"], r["head_start"], r["head_end"], r["with_index"])
            for r in lst["prefill_tp2->decode_tp1"]] == [(0, 0, 0, 1, True), (1, 0, 1, 2, False)]
    assert [(r["dp"], r["src"], r["head_start"], r["head_end"], r["with_index"])
            for r in lst["prefill_tp1->decode_dp2"]] == [(0, 0, 0, 2, True), (1, 0, 0, 2, True)]
    assert [(r["dp"], r["src"], r["head_start"]) for r in lst["prefill_tp2->decode_dp2"]] == [
        (0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    # from a dp2 prefill: the decode shard(s) listen once per prefill dp rank (tagged "src_dp")
    assert [(r["src_dp"], r["src"], r["head_start"], r["head_end"], r["with_index"])
            for r in lst["prefill_dp2->decode_tp1"]] == [(0, 0, 0, 2, True), (1, 0, 0, 2, True)]
    assert [(r["dp"], r["src_dp"]) for r in lst["prefill_dp2->decode_dp2"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("case", ["tp1->dp2", "tp2->dp2", "dp2->dp2"])
def test_requests_land_on_both_dp_ranks(run, case):
    """Least loaded with room: the 7 handed-off requests alternate over the two dp ranks."""
    ranks = list(run["cases"][case]["assignment"].values())
    assert ranks == [0, 1, 0, 1, 0, 1, 0], ranks


@pytest.mark.parametrize("case", ["dp2->tp1", "dp2->dp2"])
def test_prefill_dp_ranks_each_send_what_they_ran(run, case):
    """Placed on the prefill dp rank with the fewest prompt tokens to prefill (the prompts grow, so the 8
    requests alternate); each handed-off request's KV went out from the shards of the rank it was placed on."""
    got = run["cases"][case]
    placement = got["placement"]
    assert list(placement.values()) == [0, 1] * 4, placement
    sent_from = {s["request_id"]: s["sent_from"] for s in got["stats"]}
    assert sent_from == {rid: q for rid, q in placement.items() if rid in sent_from}
    assert set(sent_from.values()) == {0, 1}
    if case == "dp2->dp2":  # the two balancings differ in phase: each prefill rank sent into each decode rank
        assert {(placement[rid], d) for rid, d in got["assignment"].items()} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_prefill_dp_ranks_step_in_lockstep(run):
    """ep=2 spans both prefill dp ranks: every rank ran every group step, and the rank whose prompts ended
    first ran empty forwards while the other still prefilled."""
    counters = run["prefill_dp2_counters"]
    assert [c["calls"] for c in counters] == [run["prefill_dp2_steps"]] * 2
    assert sum(c["idle_forwards"] for c in counters) > 0, counters


def test_prefill_dp_placement_edges(run):
    e = run["prefill_dp_edges"]
    assert "handoff_to: a prefill engine with dp=2 hands off only requests placed first" in e["unplaced"]
    q = e["placed_then_aborted"][0]
    assert e["placed_then_aborted"] == [q, q, True, None]
    assert e["owner_after_first_token"][1] == e["owner_after_first_token"][0]  # kept while its KV travels
    assert e["pending_after_first_token"] == [0, 0]  # handed off: no prompt token left to compute
    assert e["aborted"] == [True, True]
    _assert_no_leftovers(e["prefill"], "edges prefill_dp2")
    _assert_no_leftovers(e["decode"], "edges decode_tp1")


def test_prefill_dp_placement_weighs_prompt_tokens(run):
    t = run["prefill_dp_tokens"]
    assert t["before"] == [0, 0]
    q, other = t["ranks"][0], 1 - t["ranks"][0]  # the first goes where the pages are freer: either rank
    assert t["ranks"] == [q, other, other], t["ranks"]  # counting requests: [q, other, q]

    def on(long_side: int, other_side: int) -> list[int]:
        return [long_side, other_side] if q == 0 else [other_side, long_side]

    assert t["held"] == on(150, 10)
    assert t["owned"] == on(150, 10)  # added, nothing computed yet: the cores' prompts, no placement left
    assert t["unsaid"] == other and t["with_unsaid"] == on(150, 11)  # a placement without num_tokens weighs 1
    assert t["after_step"] == on(150 - 128, 1)  # one chunk of the long prompt; the short ones decode now
    assert t["owners_after_step"] == [q, other, other]
    assert t["aborted"] == [True] * 4 and t["after_abort"] == [0, 0]
    _assert_no_leftovers(t["prefill"], "token placement prefill_dp2")


def test_refused_transfer_from_a_tp_group_frees_both_sides(run):
    r = run["refused"]
    assert r["outcome"][0] is False and "header mismatch" in r["outcome"][1], r["outcome"]
    assert "header mismatch" in r["failure"], r["failure"]
    assert r["broken"] == [None, None]  # refused, not broken: the pairs stay in step
    assert len(r["after"]) == 3 and r["after_outcome"] == [True, None]
    _assert_no_leftovers(r["prefill"], "refused prefill_tp2")
    _assert_no_leftovers(r["decode"], "refused decode_tp1")


def test_abort_reaches_the_admitting_dp_rank(run):
    a = run["abort_dp"]
    assert a["ranks"] == {"never": 0, "left": 1}
    assert a["outcome"] == [True, None]  # the KV landed on dp rank 1
    pages = -(-LENGTHS[6] // 16)
    assert a["held_before_abort"] == [pages, pages]
    assert a["aborted"] == [True, True]
    _assert_no_leftovers(a["prefill"], "abort prefill_tp1")
    _assert_no_leftovers(a["decode"], "abort decode_dp2")


def test_full_dp_pools_refuse_and_reserve_nothing(run):
    f = run["full_dp"]
    assert f["free_each"] == [0, 9]  # the prompt needs 10 pages
    assert f["refused"] and f["owner"] is None
    assert f["admitted"] and f["aborted"]
    _assert_no_leftovers(f["decode"], "full decode_dp2")


def test_report_timings(run):
    print(f"\nstart {run['start_s']:.1f} s, pairs {run['pairs_s']:.1f} s, "
          + ", ".join(f"{c} {v['seconds']:.2f} s" for c, v in run["cases"].items())
          + f", prefill dp token placement {run['prefill_dp_tokens']['seconds']:.2f} s"
          + f", driver {run['driver_s']:.1f} s, wall {run['wall_s']:.1f} s; tp2 transfer poll "
          f"{run['poll_ms']:.2f} ms")
    assert not run.get("shutdown_errors"), run.get("shutdown_errors")


# ---- in process: a prefill shard with no route into a group ------------------------------------------------

def test_prefill_shard_without_routes_has_nothing_to_send():
    """tp4 prefill of a 2-KV-head model into a tp1 decode: heads come from shards 0 and 2 (each head has two
    replicas); shards 1 and 3 have no route, so their `send` is DONE at once with no bytes."""
    import dataclasses

    import torch

    from msa.config import M3Config
    from msa.kv_cache import KVCache
    from msa.parallel import ParallelContext
    from workers.configio import load_yaml, preset_path
    from workers.kv.agent import TransferAgent
    from workers.kv.config import TransferState
    from workers.kv.routes import plan_routes

    config = load_yaml(preset_path("models", "tiny"), M3Config)
    assert config.num_key_value_heads == 2
    # a stand-in group: only the head split is read (no collective runs here)
    ctx = dataclasses.replace(ParallelContext.single(), tp_size=4, tp_rank=1, tp_group=object())
    idle = TransferAgent(KVCache.allocate(config, 4, device="cpu", dtype=torch.float32, ctx=ctx), role="prefill",
                         num_kv_heads=2, tp=4, tp_rank=1)
    # what a tp1 decode shard's `listen` returns (the addresses are never dialled: no route starts at rank 1)
    listened = [(dict(r.__dict__), ("127.0.0.1", 9)) for r in plan_routes(2, 4, 1)]
    assert [(r["src"], r["head_start"]) for r, _ in listened] == [(0, 0), (2, 1)]
    try:
        idle.connect("d#0", listened)
        assert idle.groups == ["d#0"] and idle.broken("d#0") is None
        idle.send_many([("t", [0, 1], None)], "d#0")
        res = idle.results(["t"])[0]
        assert (res.state, res.settled, res.num_bytes, res.num_pages) == (TransferState.DONE, True, 0, 2)
        assert idle.transfer_ids() == ["t"]
        with pytest.raises(ValueError, match="already has a transfer"):
            idle.send_many([("t", [0, 1], None)], "d#0")
        assert idle.abort("t") and idle.release("t").state is TransferState.DONE and idle.transfer_ids() == []
        with pytest.raises(ValueError, match="^group: no pairs to 'x#0'"):
            idle.send_many([("u", [0], None)], "x#0")
    finally:
        idle.close()


def test_combine_over_shards():
    from workers.kv.agent import TransferAgent
    from workers.kv.config import TransferState as S
    from workers.kv.endpoint import TransferResult

    def r(state, settled, n=10, why=None):
        return TransferResult(request_id="x", state=state, settled=settled, reason=why, num_bytes=n, seconds=n / 10,
                              num_pages=2, marks={"called": 1.0, "acked": n / 10} if settled else {"called": 2.0})

    assert TransferAgent.combine("x", [r(S.DONE, True), r(S.TRANSFERRING, False)]).state is S.TRANSFERRING
    both = TransferAgent.combine("x", [r(S.DONE, True, 10), r(S.DONE, True, 30)])
    assert (both.state, both.settled, both.num_bytes, both.seconds) == (S.DONE, True, 40, 3.0)
    assert both.marks == {"called": 1.0, "acked": 3.0}  # each phase: the latest shard's
    bad = TransferAgent.combine("x", [r(S.FAILED, True, why="a: timeout"), r(S.PENDING, False)])
    assert (bad.state, bad.settled, bad.reason) == (S.FAILED, False, "a: timeout")
    assert TransferAgent.combine("x", [r(S.PENDING, False), r(S.PENDING, False)]).state is S.PENDING


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.workers.disagg_helpers
    _ckpt, _out = sys.argv[1], Path(sys.argv[2])
    _out.write_text(json.dumps(drive(_ckpt)))
