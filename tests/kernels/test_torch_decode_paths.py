"""The CPU serving path (the launchers' default off CUDA): decode rows batched in torch, prompt rows by the
references. It must give the references' results: attention to rounding, the indexer's selection exactly (ties
to the lower block, -1 padding, forced local blocks), on mixed batches whose rows differ in length, request and
page-table padding."""
from __future__ import annotations

import pytest
import torch

from kernels import attention, index_topk as itk

PS, HKV, DI = 16, 2, 16
LENS = [7, 3 * PS, 5 * PS + 3, 2 * PS + 1]
# prompt rows first, grouped by request (the metadata's contract), then decode rows: two rows of one request at
# different positions, a row on a block's last key, one on a block's first
PROMPT_ROWS = [(0, 4), (0, 5), (0, 6), (1, 3 * PS - 3)]
DECODE_ROWS = [(1, 3 * PS - 1), (2, 5 * PS + 2), (2, 4 * PS - 1), (3, 2 * PS), (0, 6)]
ROWS = PROMPT_ROWS + DECODE_ROWS


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,group,head_dim", [(torch.float32, 2, 16), (torch.float16, 4, 32)])
def test_attention_default_path_equals_the_reference(paged_case, dtype, group, head_dim):
    case = paged_case(context_lens=LENS, rows=ROWS, page_size=PS, kv_heads=HKV, head_dim=head_dim, index_dim=DI,
                      seed=21, dtype=dtype, extra_table_cols=3)
    gen = torch.Generator().manual_seed(22)
    q = torch.randn(len(ROWS), group * HKV, head_dim, generator=gen).to(dtype)
    block_ids = itk.index_topk_ref(torch.randn(len(ROWS), HKV, DI, generator=gen), case.index_k_cache.float(),
                                   case.page_tables, case.row_seq, case.positions, 2, 1)
    assert (block_ids == -1).any() and (block_ids[:, 0] != block_ids[:, 1]).any()  # padding; heads differ
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for npf in (len(PROMPT_ROWS), 0):  # a mixed step; every row taken as a decode row (rows stand alone)
        got = attention.sparse_attention(*args, block_ids, 0.3, num_prefill_rows=npf)
        assert got.dtype == dtype and _rel(got, attention.paged_attention_ref(*args, 0.3, block_ids)) < tol
        got = attention.dense_attention(*args, 0.3, num_prefill_rows=npf)
        assert _rel(got, attention.paged_attention_ref(*args, 0.3)) < tol
    # the sparse mask matters: the dense result is far from the sparse one on these rows
    assert _rel(attention.dense_attention(*args, 0.3), attention.sparse_attention(*args, block_ids, 0.3)) > 0.05
    none = attention.paged_decode_attention_torch(q[:0], *args[1:3], case.page_tables, case.row_seq[:0],
                                                  case.positions[:0], 0.3)
    assert none.shape == (0, group * HKV, head_dim)


@pytest.mark.parametrize("topk", [2, 4, 9])
def test_indexer_default_path_selects_exactly_the_references_blocks(paged_case, topk):
    case = paged_case(context_lens=LENS, rows=ROWS, page_size=PS, kv_heads=HKV, head_dim=16, index_dim=DI, seed=23,
                      extra_table_cols=3)
    q = torch.randn(len(ROWS), HKV, DI, generator=torch.Generator().manual_seed(24))
    args = (case.page_tables, case.row_seq, case.positions, topk, 1)
    want = itk.index_topk_ref(q, case.index_k_cache, *args)
    for npf in (len(PROMPT_ROWS), 0):
        assert torch.equal(itk.index_topk(q, case.index_k_cache, *args, num_prefill_rows=npf), want)
    assert (want == -1).any() and (want[len(PROMPT_ROWS):] >= 0).sum() > 0  # -1 tails (short rows) and picks
    # integer keys: many equal block maxima, so the tie order decides the selection
    ikc = torch.randint(0, 2, case.index_k_cache.shape, generator=torch.Generator().manual_seed(25)).float()
    ones = torch.ones_like(q)
    want = itk.index_topk_ref(ones, ikc, *args)
    assert torch.equal(itk.index_topk(ones, ikc, *args, num_prefill_rows=len(PROMPT_ROWS)), want)
    flat = itk.index_topk(ones, torch.ones_like(ikc), *args)  # all equal: the lowest ids and the own block
    row = DECODE_ROWS.index((2, 5 * PS + 2)) + len(PROMPT_ROWS)
    assert flat[row, 0].tolist()[:min(topk, 6)] == ([0, 5] if topk == 2 else [0, 1, 2, 5] if topk == 4
                                                     else [0, 1, 2, 3, 4, 5])
