"""Decode CUDA graphs on a CUDA device (workers/cuda_graph.py), tiny model: replay against the eager step in
fp32 and bf16 over batch sizes on and off the buckets, shuffled page tables, contexts crossing page boundaries
and growing across steps; the engine's greedy tokens with graphs on and off; the eager fallback past the largest
bucket.

  .venv/bin/pytest -q -s tests/workers/test_cuda_graph_gpu.py
"""
from __future__ import annotations

import logging
import random
import statistics

import pytest
import torch

from msa.kv_cache import KVCache
from msa.metadata import ChunkSpec, build_metadata
from workers.config import EngineConfig
from workers.request import SamplingParams

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

SIZES = (1, 2, 4, 8, 16)
NUM_PAGES = 400
MAX_LEN = 512  # 32 table columns of 16-token pages
# batch sizes of successive steps: on and off the buckets, shrinking inside one bucket (16 -> 13: stale rows
# become padding), jumping between buckets
STEP_SIZES = (16, 13, 3, 1, 5, 8, 16, 11, 2, 16, 7, 6, 16, 9)


def _clone(kv: KVCache) -> KVCache:
    return KVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v],
                   index_k=[None if t is None else t.clone() for t in kv.index_k], num_pages=kv.num_pages,
                   page_size=kv.page_size)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _row_rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).abs().amax(-1) / want.abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_matches_eager_across_batch_sizes_and_growing_contexts(tiny_ckpt, dtype, caplog):
    from workers.runner import ModelRunner

    caplog.set_level(logging.INFO, logger="m3serve.runner")
    cfg = EngineConfig(num_pages=NUM_PAGES, dtype=dtype, max_num_seqs=16, max_model_len=MAX_LEN,
                       cuda_graph_batch_sizes=SIZES)
    runner = ModelRunner(tiny_ckpt, engine_config=cfg, device=DEVICE)
    graphs, model, kv = runner.graphs, runner.model, runner.kv
    assert graphs is not None and graphs.captured and graphs.sizes == SIZES and graphs.max_pages == MAX_LEN // 16
    assert "captured 5 decode CUDA graphs" in caplog.text
    print(f"\n{dtype}: captured {SIZES} in {graphs.capture_seconds:.2f} s, {graphs.pool_bytes / 2**20:.1f} MiB")
    ps = kv.page_size
    rng = random.Random(0)
    pool = list(range(1, NUM_PAGES))  # page 0 in no table: only padded rows point at it
    rng.shuffle(pool)
    lens = [ps - 1, ps, ps + 1, 2 * ps - 1, 1, 3 * ps, 64, 65] + [rng.randrange(2, 300) for _ in range(8)]
    tables = []
    with torch.inference_mode():
        for r, n in enumerate(lens):  # prefill each request eagerly
            need = (n + len(STEP_SIZES)) // ps + 1
            table, pool = pool[:need], pool[need:]
            tables.append(table)
            ids = torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(r)).to(DEVICE)
            model(ids, build_metadata([ChunkSpec(table, 0, n, False)], ps, DEVICE), kv)
    kv_eager = _clone(kv)
    next_tok = [rng.randrange(3, 384) for _ in lens]
    padded_errs, eager_errs, agree, bitwise = [], [], [], True
    for b in STEP_SIZES:
        rows = rng.sample(range(len(lens)), b)  # a random subset in random order
        chunks = [ChunkSpec(tables[r][:lens[r] // ps + 1], lens[r], 1, True) for r in rows]
        ids = [next_tok[r] for r in rows]
        with torch.inference_mode():
            got = graphs.run(chunks, ids).clone()
            # the same padded step run eagerly on the static buffers (rewrites the same K/V into the same slots)
            padded = graphs.forward(graphs.bucket(b))[:b].clone()
            meta = build_metadata(chunks, ps, DEVICE)
            want = model.compute_logits(model(torch.tensor(ids, device=DEVICE), meta, kv_eager)[meta.logits_indices])
        assert got.shape == want.shape == (b, model.config.vocab_size) and torch.isfinite(got).all()
        bitwise &= torch.equal(got, padded)
        padded_errs.append(_row_rel(got, padded))
        eager_errs.append(_row_rel(got, want))
        agree.append(got.argmax(-1) == want.argmax(-1))
        for r, t in zip(rows, want.argmax(-1).tolist()):  # both paths are fed the eager path's tokens
            next_tok[r] = t
            lens[r] += 1
    padded_err, eager_err = torch.cat(padded_errs), torch.cat(eager_errs)
    agreement = torch.cat(agree).float().mean().item()
    print(f"{dtype}: replay vs padded eager: bitwise {bitwise}, max rel {padded_err.max():.2e}; replay vs eager "
          f"step: max rel {eager_err.max():.2e}, median {eager_err.median():.2e}, argmax agreement {agreement:.3f}")
    if dtype == "float32":
        # split counts, GEMM tiles and the MoE config follow the batch size: rounding, nothing more
        assert padded_err.max() <= 1e-5 and eager_err.max() <= 1e-3 and agreement == 1.0
    else:
        assert padded_err.median() <= 0.02 and eager_err.median() <= 0.02 and agreement >= 0.9
    for layer in range(kv.num_layers):  # padded rows (slot -1) never wrote the KV pool
        assert not kv.k[layer][0].any() and not kv.v[layer][0].any()
        assert kv.index_k[layer] is None or not kv.index_k[layer][0].any()


def _prompts(seed: int, lengths):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in lengths]


def _same_outputs(got, want) -> float:
    """Assert equal greedy tokens; -> the largest |logprob difference| seen."""
    worst = 0.0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for dg, dw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            worst = max(worst, max(abs(dg[t] - dw[t]) for t in dg.keys() & dw.keys()))
    return worst


def _decode_steps(llm):
    return [s for s in llm.engine.pop_step_stats() if s.num_prefill_tokens == 0]


def test_engine_16_concurrent_greedy_requests_equal_with_graphs_on_and_off(tiny_ckpt):
    from workers.llm import LLM

    rng = random.Random(5)
    prompts = _prompts(1, [5, 15, 16, 17, 31, 32, 33, 64, 65, 100, 127, 128, 129, 150, 200, 257])
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 48), ignore_eos=True, logprobs=2)
              for _ in prompts]
    off = LLM(tiny_ckpt, device=DEVICE, num_pages=512, max_num_seqs=16, enforce_eager=True)
    assert off.engine.executor.runner.graphs is None
    want = off.generate(prompts, params)
    off_steps = _decode_steps(off)
    off.engine.shutdown()

    on = LLM(tiny_ckpt, device=DEVICE, num_pages=512, max_num_seqs=16)  # default buckets, max_model_len 4096
    runner = on.engine.executor.runner
    assert runner.info()["cuda_graph_sizes"] == [1, 2, 4, 8, 16] and runner.graphs.max_pages == 4096 // 16
    warmup_graph_steps = runner.num_graph_steps  # the engine's start-up warm-up replays graphs too (workers/warmup.py)
    got = on.generate(prompts, params)
    on_steps = _decode_steps(on)
    worst = _same_outputs(got, want)
    # every pure-decode step replayed a graph (the batch shrank from 16 through every bucket as requests ended)
    assert runner.num_graph_steps - warmup_graph_steps == len(on_steps) > 0
    assert len({s.batch_size for s in on_steps}) >= 5

    def med(steps, b):
        return 1e3 * statistics.median(s.step_time for s in steps if s.batch_size == b)

    print(f"\nengine decode step at B=16: graphs {med(on_steps, 16):.2f} ms, eager {med(off_steps, 16):.2f} ms; "
          f"capture {runner.graphs.capture_seconds:.2f} s; max |logprob diff| {worst:.2e}")
    assert worst < 1e-3
    assert on.engine.stats().num_pages_free == on.engine.num_pages
    on.engine.shutdown()


def test_steps_past_the_largest_bucket_run_eagerly(tiny_ckpt):
    from workers.llm import LLM

    prompts = _prompts(2, [20, 33, 47, 16, 70, 9])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (4, 6, 8, 10, 12, 14)]
    llm = LLM(tiny_ckpt, device=DEVICE, num_pages=256, max_num_seqs=8, max_model_len=256,
              cuda_graph_batch_sizes=(1, 2, 4))
    runner = llm.engine.executor.runner
    warmup_graph_steps = runner.num_graph_steps
    got = llm.generate(prompts, params)
    steps = _decode_steps(llm)
    small = sum(s.batch_size <= 4 for s in steps)
    assert small and len(steps) > small  # steps of 6 and 5 rows ran eagerly, 4 and fewer replayed
    assert runner.num_graph_steps - warmup_graph_steps == small
    llm.engine.shutdown()
    eager = LLM(tiny_ckpt, device=DEVICE, num_pages=256, max_num_seqs=8, max_model_len=256, enforce_eager=True)
    assert _same_outputs(got, eager.generate(prompts, params)) < 1e-3
    eager.engine.shutdown()
