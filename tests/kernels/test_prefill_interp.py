"""The prefill kernels (kernels/prefill_attention.py, kernels/prefill_index.py) vs their torch references on CPU,
through the Triton interpreter (fp32/fp16, tiny shapes): varlen batches of several requests with cached prefixes
that are not multiples of the page size, chunks that start and end inside a block, GQA groups, -1 padded sparse
selections, and mixed prefill + decode steps through the public launchers.

TRITON_INTERPRET is set by tests/kernels/conftest.py before triton is first imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import attention, index_topk as itk  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from kernels.prefill_index import prefill_index_topk  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here (see test_kernels_gpu.py)", allow_module_level=True)

PS, HKV, D, DI = 16, 2, 16, 16
# (context length after the chunk, chunk start) per request: prefixes of 0, 45 and 90 tokens (none a page
# multiple but the first), chunks ending inside a block, one chunk of a single block's tail
CHUNKS = [(70, 45), (33, 0), (100, 90), (47, 38)]


def _prefill_case(make, chunks, *, dtype=torch.float32, seed=0, group=4, index_heads=HKV, decode=(), page_size=PS):
    """Prompt rows of `chunks` (request r: positions start .. ctx - 1, requests in order), then one decode row per
    (context length) in `decode` -> (case, query_start_loc, max chunk rows, q, q_idx)."""
    lens = [c for c, _ in chunks] + list(decode)
    rows = [(r, p) for r, (c, s) in enumerate(chunks) for p in range(s, c)]
    rows += [(len(chunks) + i, n - 1) for i, n in enumerate(decode)]
    case = make(context_lens=lens, rows=rows, page_size=page_size, kv_heads=HKV, head_dim=D, index_dim=DI, dtype=dtype,
                seed=seed)
    qsl = [0]
    for c, s in chunks:
        qsl.append(qsl[-1] + c - s)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(rows), HKV * group, D, generator=g).to(dtype)
    q_idx = torch.randn(len(rows), index_heads, DI, generator=g).to(dtype)
    return case, torch.tensor(qsl, dtype=torch.int32), max(c - s for c, s in chunks), q, q_idx


def _random_selection(positions, hkv, topk, seed):
    """Ascending visible block ids per (row, KV head), own block always in, -1 tail (some rows short)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(positions), hkv, topk), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        own = p // PS
        for h in range(hkv):
            others = torch.randperm(own, generator=g)[:int(torch.randint(0, topk, (1,), generator=g))]
            ids = sorted([own, *others.tolist()])
            out[i, h, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("topk,local,splits,heads", [(3, 1, 1, 2), (3, 1, 3, 2), (2, 2, 2, 3), (4, 1, 1, 1)])
def test_prefill_index_matches_ref(paged_case, dtype, topk, local, splits, heads):
    case, qsl, max_len, _, q_idx = _prefill_case(paged_case, CHUNKS, dtype=dtype, seed=1, index_heads=heads)
    want = itk.index_topk_ref(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, topk, local)
    got = torch.full_like(want, -(2**30))
    prefill_index_topk(q_idx, case.index_k_cache, case.page_tables, qsl, case.positions, topk, local,
                       num_requests=len(CHUNKS), max_len=max_len, out=got, launch={"splits": splits, "rows": 16})
    assert torch.equal(got, want)


@pytest.mark.parametrize("local", [0, 1])
def test_prefill_index_ties_go_to_the_lower_block(paged_case, local):
    # index-K of equal pages: every block of a row scores the same, so the selection is the lowest ids (+ the
    # own block when forced); without the forced block a later tie must never displace an earlier one
    case, qsl, max_len, _, q_idx = _prefill_case(paged_case, [(100, 60)], seed=2)
    k = case.index_k_cache
    k[:] = k[int(case.page_tables[0, 0])]
    for splits in (1, 2):
        got = prefill_index_topk(q_idx, k, case.page_tables, qsl, case.positions, 3, local, num_requests=1,
                                 max_len=max_len, launch={"splits": splits})
        want = itk.index_topk_ref(q_idx, k, case.page_tables, case.row_seq, case.positions, 3, local)
        assert torch.equal(got, want), splits
    own = case.positions // PS
    lowest = torch.tensor([0, 1] if local else [0, 1, 2])
    assert (got[:, 0, :len(lowest)].long() == lowest).all()
    if local:
        assert torch.equal(got[:, 0, 2].long(), own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("launch", [{"tokens": 4, "heads": "group", "block_n": 16},
                                    {"tokens": 16, "heads": 1, "block_n": 16},
                                    {"tokens": 8, "heads": 2, "block_n": 16}])
def test_dense_prefill_matches_ref(paged_case, dtype, launch):
    case, qsl, max_len, q, _ = _prefill_case(paged_case, CHUNKS, dtype=dtype, seed=3)
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25)
    got = torch.full_like(q, float("nan"))
    prefill_attention(q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25,
                      num_requests=len(CHUNKS), max_len=max_len, out=got, launch=launch)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_sparse_prefill_matches_ref(paged_case, dtype, tokens):
    # G = 8 query heads per KV head, so one token is already a 16-row tile (tokens = 1: the per-token kernel)
    case, qsl, max_len, q, _ = _prefill_case(paged_case, CHUNKS, dtype=dtype, seed=4, group=8)
    sel = _random_selection(case.positions, HKV, 4, seed=5)
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    got = torch.full_like(q, float("nan"))
    prefill_attention(q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25, sel,
                      num_requests=len(CHUNKS), max_len=max_len, out=got, launch={"tokens": tokens, "block_n": 16})
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_sparse_prefill_with_wide_pages_and_sub_tiles(paged_case):
    # 32 keys per page read as two 16-key tiles; selections of the real indexer (ascending, -1 tail)
    case, qsl, max_len, q, q_idx = _prefill_case(paged_case, [(150, 70), (40, 0)], seed=6, page_size=32)
    sel = itk.index_topk_ref(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 2, 1)
    assert (sel == -1).any() and (sel[:, :, 1] >= 0).any()
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25, sel)
    got = prefill_attention(q, case.k_cache, case.v_cache, case.page_tables, qsl, case.positions, 0.25, sel,
                            num_requests=2, max_len=max_len, launch={"block_n": 16})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("from_metadata", [True, False])
def test_mixed_prefill_and_decode_rows_through_the_launchers(paged_case, from_metadata):
    """Prompt rows of three requests, then three decode rows (the batch suffix): each span to its kernel, every
    row equal to the reference, nothing copied. The prompt layout comes from the metadata, or from row_seq."""
    chunks = CHUNKS[:3]
    case, qsl, max_len, q, q_idx = _prefill_case(paged_case, chunks, seed=7, decode=(20, 77, 130))
    npf = int(qsl[-1])
    prefill = (qsl, len(chunks), max_len) if from_metadata else None
    args = (case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    sel = itk.index_topk(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 3, 1,
                         num_prefill_rows=npf, backend="triton", prefill=prefill)
    want_sel = itk.index_topk_ref(q_idx, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 3, 1)
    assert torch.equal(sel, want_sel)
    dense = attention.dense_attention(q, *args, 0.25, num_prefill_rows=npf, backend="triton", prefill=prefill)
    torch.testing.assert_close(dense, attention.paged_attention_ref(q, *args, 0.25), atol=1e-5, rtol=1e-5)
    sparse = attention.sparse_attention(q, *args, sel, 0.25, num_prefill_rows=npf, backend="triton",
                                        prefill=prefill)
    torch.testing.assert_close(sparse, attention.paged_attention_ref(q, *args, 0.25, sel), atol=1e-5, rtol=1e-5)


def test_prompt_rows_must_come_grouped_by_request():
    from kernels._paged import prefill_layout

    qsl, n, longest = prefill_layout(torch.tensor([0, 0, 1, 1, 1, 2, 5], dtype=torch.int32), 6)
    assert qsl.tolist() == [0, 2, 5, 6] and n == 3 and longest == 3
    with pytest.raises(ValueError, match="grouped by request"):
        prefill_layout(torch.tensor([0, 1, 0], dtype=torch.int32), 3)
