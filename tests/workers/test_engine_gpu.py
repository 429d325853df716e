"""The engine on a CUDA device (Triton kernels, KV pool sized from free memory): the same greedy tokens as the
CPU engine, and the host overhead of a decode step."""
from __future__ import annotations

import random
import statistics

import pytest
import torch

from workers.llm import LLM
from workers.request import SamplingParams

pytestmark = pytest.mark.gpu


def test_cuda_engine_matches_cpu_and_reports_host_overhead(tiny_ckpt):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 17, 64, 65, 130, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    cpu = LLM(tiny_ckpt, num_pages=128).generate(prompts, params)

    free_before = torch.cuda.mem_get_info()[0]
    llm = LLM(tiny_ckpt, device="cuda", gpu_memory_utilization=0.02, max_num_seqs=32)
    eng = llm.engine
    # a 2% budget of (a lot of) free memory: the pool is sized from the device, not from kv_cache_bytes
    assert eng.executor.info()["kv_bytes"] <= 0.02 * free_before and eng.num_pages > 1000
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # compile the kernels
    eng.pop_step_stats()
    gpu = llm.generate(prompts, params)
    worst = 0.0
    for c, g in zip(cpu, gpu):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids
        for dc, dg in zip(c.outputs[0].logprobs, g.outputs[0].logprobs):
            worst = max(worst, max(abs(dc[t] - dg[t]) for t in dc.keys() & dg.keys()))
    steps = [s for s in eng.pop_step_stats() if s.num_prefill_tokens == 0]
    overhead_ms = 1e3 * statistics.median(s.host_overhead for s in steps)
    step_ms = 1e3 * statistics.median(s.step_time for s in steps)
    print(f"\ncuda decode step (batch {steps[0].batch_size}): {step_ms:.2f} ms, host overhead {overhead_ms:.2f} ms; "
          f"max |logprob diff| vs CPU {worst:.2e}; pool {eng.num_pages} pages")
    assert worst < 1e-3
    assert eng.stats().num_pages_free == eng.num_pages
