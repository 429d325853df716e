"""The prefill kernels vs their torch references on the GPU at the real M3 shapes (bf16): 64 query heads over 4 KV
heads, head_dim 128, 4 index heads, pages = blocks of 128, top-16; a varlen batch of three prompt chunks with
cached prefixes that are not page multiples, and a mixed step with decode rows behind them."""
from __future__ import annotations

import pytest
import torch

from kernels import attention, index_topk as itk, prefill_sparse_split as split_mod
from kernels.prefill_attention import prefill_attention
from kernels.prefill_index import prefill_index_topk
from kernels.prefill_sparse_split import prefill_sparse_split

pytestmark = pytest.mark.gpu

PS, HKV, HQ, D, HI, DI, TOPK = 128, 4, 64, 128, 4, 128, 16
CHUNKS = [(3000, 1100), (700, 0), (2500, 2301)]  # (context after the chunk, chunk start)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _case(make, chunks, decode=(), seed=0):
    lens = [c for c, _ in chunks] + list(decode)
    rows = [(r, p) for r, (c, s) in enumerate(chunks) for p in range(s, c)]
    rows += [(len(chunks) + i, n - 1) for i, n in enumerate(decode)]
    case = make(context_lens=lens, rows=rows, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI,
                dtype=torch.bfloat16, device="cuda", seed=seed)
    qsl = [0]
    for c, s in chunks:
        qsl.append(qsl[-1] + c - s)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(len(rows), HQ, D, device="cuda", generator=g).bfloat16()
    qi = torch.randn(len(rows), HI, DI, device="cuda", generator=g).bfloat16()
    layout = (torch.tensor(qsl, dtype=torch.int32, device="cuda"), len(chunks), max(c - s for c, s in chunks))
    return case, layout, q, qi


def test_prefill_index_gpu(paged_case):
    case, (qsl, nreq, longest), _, qi = _case(paged_case, CHUNKS, seed=1)
    args = (qi, case.index_k_cache, case.page_tables)
    want = itk.index_topk_ref(*args, case.row_seq, case.positions, TOPK, 1)
    for launch in ({}, {"splits": 1}, {"splits": 3}, {"rows": 128}, {"rows": 32, "num_warps": 8}):
        got = torch.full_like(want, -(2**30))
        prefill_index_topk(*args, qsl, case.positions, TOPK, 1, num_requests=nreq, max_len=longest, out=got,
                           launch=launch)
        assert torch.equal(got, want), launch


@pytest.mark.parametrize("sparse", [False, True])
def test_prefill_attention_gpu(paged_case, sparse):
    case, (qsl, nreq, longest), q, qi = _case(paged_case, CHUNKS, seed=2)
    sel = itk.index_topk_ref(qi, case.index_k_cache, case.page_tables, case.row_seq, case.positions, TOPK, 1) \
        if sparse else None
    args = (q, case.k_cache, case.v_cache, case.page_tables)
    want = attention.paged_attention_ref(*args, case.row_seq, case.positions, D ** -0.5, sel)
    launches = ([{"tokens": t, "block_n": n} for t in (1, 2, 4, 8) for n in (64, 128)] if sparse else
                [{"tokens": 8, "heads": "group"}, {"tokens": 128, "heads": 1, "block_n": 128},
                 {"tokens": 64, "heads": 1, "block_n": 64, "num_warps": 8}, {"tokens": 16, "heads": 8}])
    for launch in launches:
        got = torch.full_like(q, float("nan"))
        prefill_attention(*args, qsl, case.positions, D ** -0.5, sel, num_requests=nreq, max_len=longest,
                          out=got, launch=launch)
        assert not got.isnan().any(), launch
        assert _rel(got, want) < 1e-2, launch


def test_block_major_sparse_gpu(paged_case):
    """The block-major kernel at 2,048 new tokens after 6,144 cached (one request, the bench's 2k x 8k case) and on
    the varlen chunks, several launches (W below and above the segments, half-page tiles, row slices that do not
    divide the rows, the mask always applied), against the reference; the dispatch picks it for the first."""
    for chunks in ([(8192, 6144)], CHUNKS):
        case, (qsl, nreq, longest), q, qi = _case(paged_case, chunks, seed=5)
        sel = prefill_index_topk(qi, case.index_k_cache, case.page_tables, qsl, case.positions, TOPK, 1,
                                 num_requests=nreq, max_len=longest)
        args = (q, case.k_cache, case.v_cache, case.page_tables)
        want = attention.paged_attention_ref(*args, case.row_seq, case.positions, D ** -0.5, sel)
        if nreq == 1:
            assert attention.prompt_kind(q.shape[0], nreq, case.page_tables.shape[1], sel, HKV) == "block_major"
        # the default (the work list's persistent kernel, then the split) three times: the kernel's first grid
        # is a program per SM, later ones what fits on the device, and the repeats go through the compiled
        # launchers; then other variants, the work list + split as launches of their own, and the split inside
        # the persistent kernel (twice: its own first grid, then what fits)
        for launch in (None, None, {"max_rows": 1000},
                       {"pairs": 32, "sub": 2, "block_n": 64, "num_warps": 8, "max_rows": 1000},
                       {"pairs": 128, "num_stages": 1, "mask_branch": False, "evict_first": False},
                       {"fused": False}, {"fused": False, "pairs": 128, "max_rows": 1000},
                       {"fuse_split": True}, {"fuse_split": True}, {"fuse_split": True, "max_rows": 1000}):
            got = torch.full_like(q, float("nan"))
            prefill_sparse_split(*args, qsl, case.positions, D ** -0.5, sel, num_requests=nreq, max_len=longest,
                                 out=got, launch=launch)
            assert not got.isnan().any(), launch
            assert _rel(got, want) < 1e-2, launch
        del want
    assert split_mod._FUSED.direct_launches > 0  # the repeated launches skipped the JIT (kernels/_triton.py)
    assert split_mod._SPLIT.direct_launches > 0


def test_mixed_step_gpu(paged_case):
    # three prompt chunks, then 5 decode rows: every row through its kernel, one launch of each per span
    case, layout, q, qi = _case(paged_case, CHUNKS, decode=(9000, 130, 4097, 2048, 17), seed=3)
    npf = int(layout[0][-1])
    tail = (case.row_seq, case.positions)
    sel = itk.index_topk(qi, case.index_k_cache, case.page_tables, *tail, TOPK, 1, num_prefill_rows=npf,
                         prefill=layout)
    assert torch.equal(sel, itk.index_topk_ref(qi, case.index_k_cache, case.page_tables, *tail, TOPK, 1))
    args = (q, case.k_cache, case.v_cache, case.page_tables, *tail)
    got = attention.sparse_attention(*args, sel, D ** -0.5, num_prefill_rows=npf, prefill=layout)
    assert _rel(got, attention.paged_attention_ref(*args, D ** -0.5, sel)) < 1e-2
    got = attention.dense_attention(*args, D ** -0.5, num_prefill_rows=npf, prefill=layout)
    assert _rel(got, attention.paged_attention_ref(*args, D ** -0.5)) < 1e-2


def test_prefill_fp32_defaults_fit_gpu(paged_case):
    # fp32 models (the parity runs) take the default launches too: their tiles must fit in shared memory
    case, (qsl, nreq, longest), q, qi = _case(paged_case, CHUNKS[:2], seed=4)
    f = {name: getattr(case, name).float() for name in ("k_cache", "v_cache", "index_k_cache")}
    q, qi = q.float(), qi.float()
    sel = prefill_index_topk(qi, f["index_k_cache"], case.page_tables, qsl, case.positions, TOPK, 1,
                             num_requests=nreq, max_len=longest)
    assert torch.equal(sel, itk.index_topk_ref(qi, f["index_k_cache"], case.page_tables, case.row_seq,
                                               case.positions, TOPK, 1))
    args = (q, f["k_cache"], f["v_cache"], case.page_tables)
    for block_ids in (None, sel):
        got = prefill_attention(*args, qsl, case.positions, D ** -0.5, block_ids, num_requests=nreq, max_len=longest)
        want = attention.paged_attention_ref(*args, case.row_seq, case.positions, D ** -0.5, block_ids)
        assert _rel(got, want) < 1e-5
