"""Async scheduling on a CUDA device (decode CUDA graphs, Triton kernels): the same greedy tokens as the
synchronous engine, in fp32 and in bf16 with near-ties accounted for. The two engines batch rows with different
neighbours (a request added between steps is scheduled one step later by the synchronous one), so GEMM rounding
differs: a greedy token (fp32 rarely, bf16 more often) may flip a token where its top two logprobs are within
the rounding, after which that request's continuation differs (as for graphs vs eager, docs/benchmarks.md).

First run on the H200 on 2026-12-02 (both dtypes passed); the default switch (None) turns it on there."""
from __future__ import annotations

import random

import pytest

from workers.config import EngineConfig
from workers.engine import Engine
from workers.request import SamplingParams

pytestmark = pytest.mark.gpu

NEAR_TIE = {"float32": 1e-3, "bfloat16": 5e-2}  # logprob gap under which a flipped greedy token is a near-tie


def _run(ckpt, dtype: str, async_scheduling: bool | None, prompts: list[list[int]]):
    cfg = EngineConfig(async_scheduling=async_scheduling, dtype=dtype, gpu_memory_utilization=0.05,
                       max_num_seqs=16, max_model_len=512)
    eng = Engine(ckpt, engine_config=cfg, device="cuda", executor="local")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
        eng.add_request("warm", prompts[0], SamplingParams(temperature=0.0, max_tokens=3))
        while eng.has_unfinished():
            eng.step()
        graph_steps0 = eng.executor.runner.num_graph_steps
        final, step = {}, 0
        while step < len(prompts) or eng.has_unfinished():
            if step < len(prompts):  # one arrival per step: decode rows and prefills share steps
                eng.add_request(f"r{step}", prompts[step], params)
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0]
            step += 1
        assert eng.stats().num_pages_free == eng.num_pages
        return final, eng.executor.runner.num_graph_steps - graph_steps0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_tokens_match_sync_on_cuda(tiny_ckpt, dtype):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 17, 64, 65, 130, 9, 33, 200)]
    sync, _ = _run(tiny_ckpt, dtype, False, prompts)
    asyn, graph_steps = _run(tiny_ckpt, dtype, None if dtype == "bfloat16" else True, prompts)  # None: the default
    assert graph_steps > 0, "no decode step replayed a graph (the deferred ids were not tested on that path)"
    tol = NEAR_TIE[dtype]
    matched = total = 0
    for rid, s in sync.items():
        a = asyn[rid]
        total += len(s.token_ids)
        for i, (ts, ta) in enumerate(zip(s.token_ids, a.token_ids)):
            if ts != ta:
                # a flip must be a near-tie in both runs: each run's logprob of the other's token is close to its own
                ls, la = s.logprobs[i], a.logprobs[i]
                assert ta in ls and ts in la, f"{rid} token {i}: {ts} vs {ta} is no near-tie (not in the top 5)"
                assert ls[ts] - ls[ta] < tol and la[ta] - la[ts] < tol, f"{rid} token {i}: {ts} vs {ta}"
                break
            matched += 1
    assert matched >= 0.75 * total


def test_async_scheduling_is_the_default_on_cuda(tiny_ckpt):
    eng = Engine(tiny_ckpt, engine_config=EngineConfig(gpu_memory_utilization=0.05, max_model_len=256),
                 device="cuda", executor="local")
    try:
        assert eng.engine_config.async_scheduling is True and eng._runs_async()
    finally:
        eng.shutdown()
