"""The model on CUDA: decode rows take the Triton kernels (kernels/ routes them on CUDA tensors), prefill rows
the reference path. Compared with the CPU fp32 model, which the CPU tests hold to the transformers reference."""
from __future__ import annotations

import pytest
import torch

from msa.kv_cache import KVCache
from msa.metadata import ChunkSpec, build_metadata

pytestmark = pytest.mark.gpu


def _step(model, kv, chunks, ids):
    meta = build_metadata(chunks, kv.page_size, kv.k[0].device)
    return model.compute_logits(model(ids.to(kv.k[0].device), meta, kv)[meta.logits_indices]).cpu()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, None)])
def test_cuda_chunked_prefill_and_decode_match_cpu(ckpts, mh, tiny_cfg, dtype, tol):
    cfg, n = tiny_cfg, 130
    ids = mh.random_ids(cfg, n, 11)
    cpu = ckpts.model(cfg, 0, "hub")
    want = mh.prefill_logits(cpu, ids, KVCache.allocate(cfg, 9), list(range(9)))

    model = ckpts.model(cfg, 0, "hub", device="cuda", dtype=dtype)
    kv = KVCache.allocate(cfg, 40, device="cuda", dtype=dtype)
    table = mh.shuffled_pages(40, 9, seed=3)
    got = [mh.prefill_logits(model, ids[:40], kv, table).cpu(),
           mh.prefill_logits(model, ids[40:73], kv, table, start=40).cpu()]
    got += [_step(model, kv, [ChunkSpec(table, p, 1, True)], ids[p:p + 1]) for p in range(73, n)]
    got = torch.cat(got)
    if tol is not None:
        err = mh.max_rel_err(got, want)
        print(f"cuda {dtype}: max rel err vs cpu fp32 {err:.2e}")
        assert err <= tol
    else:
        per_pos = (got - want).abs().amax(-1) / want.abs().max()
        print(f"cuda {dtype}: median per-position rel err {per_pos.median():.3f}, max {per_pos.max():.3f}")
        assert per_pos.median() <= 0.05


def test_cuda_mixed_batch_equals_separate_runs(ckpts, mh, tiny_cfg):
    cfg = tiny_cfg
    model = ckpts.model(cfg, 0, "hub", device="cuda")
    ids = {r: mh.random_ids(cfg, 120, 20 + r) for r in range(4)}
    tables = {r: list(range(r * 8, r * 8 + 8))[::-1] for r in range(4)}
    kv = KVCache.allocate(cfg, 32, device="cuda")
    for r, done in ((0, 70), (2, 90), (3, 101)):
        mh.prefill_logits(model, ids[r][:done], kv, tables[r])
    kv_sep = KVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v],
                     index_k=[None if t is None else t.clone() for t in kv.index_k], num_pages=kv.num_pages,
                     page_size=kv.page_size)
    chunks = [ChunkSpec(tables[0], 70, 25, False, all_logits=True), ChunkSpec(tables[1], 0, 40, False),
              ChunkSpec(tables[2], 90, 1, True), ChunkSpec(tables[3], 101, 1, True)]
    spans = [(0, 70, 95), (1, 0, 40), (2, 90, 91), (3, 101, 102)]
    batched = _step(model, kv, chunks, torch.cat([ids[r][a:b] for r, a, b in spans]))
    separate = torch.cat([_step(model, kv_sep, [c], ids[r][a:b]) for c, (r, a, b) in zip(chunks, spans)])
    err = mh.max_rel_err(batched, separate)
    print(f"cuda mixed batch vs separate: {err:.2e}")
    assert err <= 1e-3
