"""The paged forward is step-invariant: chunked prefill + token-by-token decode over shuffled pages equals one
full prefill (and the reference); mixed batches equal separate runs; MSA equals dense attention exactly while
every visible block fits in top-k and differs beyond it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from msa.config import FULL_ATTENTION
from msa.kv_cache import KVCache
from msa.metadata import ChunkSpec, build_metadata
from msa.model import M3ForCausalLM

SEED = 5


@pytest.fixture(scope="module")
def tiny(ckpts, tiny_cfg):
    return ckpts.model(tiny_cfg, SEED, "hub")


def _step(model, kv, chunks, ids):
    meta = build_metadata(chunks, kv.page_size)
    return model.compute_logits(model(ids, meta, kv)[meta.logits_indices])


GQA8_LOCAL2 = dict(num_hidden_layers=3, num_key_value_heads=1, index_n_heads=1, index_topk_blocks=2,
                   index_local_blocks=2, layer_types=("minimax_m3_sparse", FULL_ATTENTION, "minimax_m3_sparse"),
                   mlp_layer_types=("sparse", "dense", "sparse"))


@pytest.mark.parametrize("overrides,chunk_sizes", [({}, [37, 16, 1, 50]), ({}, [5, 64, 31]),
                                                   (GQA8_LOCAL2, [20, 47, 9])])
def test_chunked_prefill_then_decode_equals_full_prefill(ckpts, mh, overrides, chunk_sizes):
    # 130 tokens = 9 blocks of 16 vs top-4 (or top-2): selection active; decode crosses block boundaries
    cfg, n = mh.tiny_config(**overrides), 130
    model = ckpts.model(cfg, SEED, "hub")
    ids = mh.random_ids(cfg, n, 11)
    pages = -(-n // cfg.page_size)
    full = mh.prefill_logits(model, ids, KVCache.allocate(cfg, pages), list(range(pages)))
    ref = ckpts.reference_logits(cfg, SEED, ids)
    assert mh.max_rel_err(full, ref) <= 1e-4

    kv = KVCache.allocate(cfg, 3 * pages)
    table = mh.shuffled_pages(3 * pages, pages, seed=len(chunk_sizes))
    got, pos = [], 0
    for size in chunk_sizes:  # prefill chunks, each attending to the cached context before it
        got.append(mh.prefill_logits(model, ids[pos:pos + size], kv, table, start=pos))
        pos += size
    while pos < n:  # then one decode row per step
        got.append(_step(model, kv, [ChunkSpec(table, pos, 1, True)], ids[pos:pos + 1]))
        pos += 1
    got = torch.cat(got)
    assert mh.max_rel_err(got, full) <= 1e-5
    assert mh.max_rel_err(got, ref) <= 1e-4


def test_mixed_batch_equals_separate_runs(mh, tiny, tiny_cfg):
    """One step holding a continuing prefill chunk, a fresh prefill and two decode rows == four separate steps."""
    cfg = tiny_cfg
    ids = {r: mh.random_ids(cfg, 120, 20 + r) for r in range(4)}
    tables = {r: list(range(r * 8, r * 8 + 8))[::-1] for r in range(4)}
    kv = KVCache.allocate(cfg, 32)
    # history: request 0 has 70 tokens cached, request 1 none, requests 2 and 3 have 90 and 101
    for r, done in ((0, 70), (2, 90), (3, 101)):
        mh.prefill_logits(tiny, ids[r][:done], kv, tables[r])
    kv_sep = KVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v],
                     index_k=[None if t is None else t.clone() for t in kv.index_k], num_pages=kv.num_pages,
                     page_size=kv.page_size)

    chunks = [ChunkSpec(tables[0], 70, 25, False, all_logits=True), ChunkSpec(tables[1], 0, 40, False),
              ChunkSpec(tables[2], 90, 1, True), ChunkSpec(tables[3], 101, 1, True)]
    spans = [(0, 70, 95), (1, 0, 40), (2, 90, 91), (3, 101, 102)]
    batch_ids = torch.cat([ids[r][a:b] for r, a, b in spans])
    batched = _step(tiny, kv, chunks, batch_ids)

    separate = torch.cat([_step(tiny, kv_sep, [c], ids[r][a:b]) for c, (r, a, b) in zip(chunks, spans)])
    assert batched.shape == (25 + 1 + 1 + 1, cfg.vocab_size)
    assert mh.max_rel_err(batched, separate) <= 1e-5
    for a, b in zip(kv.k + kv.v + [t for t in kv.index_k if t is not None],
                    kv_sep.k + kv_sep.v + [t for t in kv_sep.index_k if t is not None]):
        # later layers' K/V carry the (rounding-level) differences of batched vs separate GEMMs
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), "the batched step wrote different cache contents"


def test_sparse_equals_dense_within_topk_and_differs_beyond(mh, tiny, tiny_cfg):
    """Same weights, every layer switched to dense attention: identical while a query sees <= top-k blocks
    (positions < topk * block), different after (so the sparse path really selects)."""
    cfg = tiny_cfg
    dense_cfg = dataclasses.replace(cfg, layer_types=(FULL_ATTENTION,) * cfg.num_hidden_layers)
    dense = M3ForCausalLM(dense_cfg)
    state = {k: v for k, v in tiny.state_dict().items() if ".indexer." not in k}
    dense.load_state_dict(state, strict=True)

    n = 160
    ids = mh.random_ids(cfg, n, 3)
    pages = n // cfg.page_size
    sparse_logits = mh.prefill_logits(tiny, ids, KVCache.allocate(cfg, pages), list(range(pages)))
    dense_logits = mh.prefill_logits(dense, ids, KVCache.allocate(dense_cfg, pages), list(range(pages)))
    within = cfg.index_topk_blocks * cfg.index_block_size  # 64: all visible blocks fit in top-k
    assert mh.max_rel_err(sparse_logits[:within], dense_logits[:within]) <= 1e-5
    beyond = (sparse_logits[within:] - dense_logits[within:]).abs().amax(-1) / dense_logits.abs().max()
    assert float(beyond.max()) > 1e-2, "sparse selection beyond top-k blocks did not change any logit"
    assert float((beyond > 1e-3).float().mean()) > 0.5, "most positions beyond top-k should differ"
