"""Decode CUDA graphs over worker groups on two GPUs (issue 24's must-show, not run yet: the 2-GPU kind was
withheld when this was written). For tp2, tp2 x ep2 and dp2 x ep2, fp32, real `ShardWorker` actors on NCCL:
every rank captures its decode graphs at startup (tp > 1 through `cuda_graph_tp`, ep > 1 through the capacity
MoE dispatch), decode steps replay them (dp2: every dp rank the same bucket, the idle one padding only), and the
greedy tokens and top-5 logprobs equal the same group run with `enforce_eager` (and the single-GPU engine).

  .venv/bin/pytest -q -s tests/workers/test_cuda_graph_multigpu.py      # on a machine with >= 2 GPUs

The driver runs in a child process (its own Ray instance, like tests/workers/test_parallel_engine.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

# name -> (tp, ep, dp); every case runs the capacity dispatch where ep > 1
CASES = {"tp2": (2, 1, 1), "tp2-ep2": (2, 2, 1), "dp2-ep2": (1, 2, 2)}
PROMPT_LENS = (90, 23, 41, 5, 64, 17)
MAX_TOKENS = (24, 6, 20, 6, 16, 12)  # dp2: the requests on dp rank 1 end first, it then idles (padding only)
TOL = 1e-4


def _requests():
    import random

    from workers.request import SamplingParams

    rng = random.Random(0)
    return [(f"r{i}", [rng.randrange(3, 384) for _ in range(n)],
             SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5))
            for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS))]


def _outputs(engine) -> dict:
    for rid, prompt, params in _requests():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = {"tokens": c.token_ids,
                                      "logprobs": [{str(k): v for k, v in d.items()} for d in c.logprobs]}
    return done


def drive(ckpt: str, out: Path) -> None:
    import ray

    from workers.config import EngineConfig, ParallelConfig
    from workers.engine import Engine, make_engine
    from workers.executor.ray_group import GroupOptions

    fields = {"num_pages": 128, "max_num_batched_tokens": 64, "max_num_seqs": 8, "dtype": "float32",
              "max_model_len": 512, "cuda_graph_batch_sizes": (1, 2, 4, 8)}
    ray.init(address="local", num_cpus=4, num_gpus=2, object_store_memory=256 * 2**20, include_dashboard=False,
             configure_logging=False)
    result: dict = {}
    try:
        single = Engine(ckpt, engine_config=EngineConfig(**fields), device="cuda")
        result["single"] = _outputs(single)
        single.shutdown()
        for name, (tp, ep, dp) in CASES.items():
            options = GroupOptions(num_cpus_per_shard=1, placement_timeout_s=120,
                                   moe_dispatch="capacity" if ep > 1 else "alltoall")
            for mode, extra in (("graphs", {"cuda_graph_tp": True}), ("eager", {"enforce_eager": True})):
                engine = make_engine(ckpt, engine_config=EngineConfig(**fields, **extra), device="cuda",
                                     parallel=ParallelConfig(tp=tp, ep=ep, dp=dp), executor=options)
                group = getattr(engine, "group", None) or engine.executor.group
                result[f"{name}/{mode}"] = {"outputs": _outputs(engine), "counters": group.call("counters"),
                                            "captured": [i["cuda_graph_sizes"] for i in group.rank_info]}
                engine.shutdown()
    finally:
        ray.shutdown()
    out.write_text(json.dumps(result))


@pytest.fixture(scope="module")
def run(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("graphs-multigpu") / "result.json"
    proc = subprocess.run([sys.executable, __file__, str(tiny_ckpt), str(out)], capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).resolve().parents[2], env=dict(os.environ))
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def _assert_same(ref: dict, got: dict, where: str) -> None:
    assert set(got) == set(ref), where
    for rid in ref:
        assert got[rid]["tokens"] == ref[rid]["tokens"], f"{where}/{rid}: tokens differ"
        for j, (a, b) in enumerate(zip(ref[rid]["logprobs"], got[rid]["logprobs"], strict=True)):
            assert set(a) == set(b), f"{where}/{rid} token {j}: top ids differ"
            assert max(abs(a[k] - b[k]) for k in a) <= TOL, f"{where}/{rid} token {j}: logprobs differ"


@pytest.mark.parametrize("case", list(CASES))
def test_graph_replay_equals_eager_on_two_gpus(run, case):
    tp, ep, dp = CASES[case]
    graphs, eager = run[f"{case}/graphs"], run[f"{case}/eager"]
    assert all(sizes == [1, 2, 4, 8] for sizes in graphs["captured"]), graphs["captured"]
    assert all(sizes == [] for sizes in eager["captured"])
    # every rank replayed decode steps (dp2: the idle dp rank too, padding only); eager never did
    assert all(c["graph_steps"] > 0 for c in graphs["counters"]), graphs["counters"]
    assert all(c["graph_steps"] == 0 for c in eager["counters"])
    if dp > 1:
        assert len({c["graph_steps"] for c in graphs["counters"]}) == 1  # the same buckets in the same steps
    _assert_same(eager["outputs"], graphs["outputs"], f"{case} graphs vs eager")
    _assert_same(run["single"], graphs["outputs"], f"{case} graphs vs one GPU")


if __name__ == "__main__":
    drive(sys.argv[1], Path(sys.argv[2]))
