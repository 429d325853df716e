"""Triton kernels vs their torch references on CPU, through the Triton interpreter (fp32/fp16, tiny shapes).

TRITON_INTERPRET must be set before triton is first imported (triton.language's own jit helpers are built at
import time), so it is set here, above every import of triton or kernels; tests/conftest.py should set it too for
runs where another test module imports triton first. On a CUDA machine Triton compiles for the GPU instead and
these tests are skipped (tests/kernels/test_kernels_gpu.py covers that side).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels import attention, index_topk as itk, paged_kv  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here (see test_kernels_gpu.py)", allow_module_level=True)
if not isinstance(attention._decode_attn_kernel, InterpretedFunction):
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py",
                pytrace=False)

PS, HKV, D, DI = 16, 2, 16, 16


# ---------------------------------------------------------------- paged_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_ref_with_padding_and_strided_inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    t, p = 9, 6
    # k and v as strided views of one fused projection output, the way the model produces them
    fused = torch.randn(t, 2 * HKV * D + DI, generator=gen)
    k = fused[:, :HKV * D].view(t, HKV, D)
    v = fused[:, HKV * D:2 * HKV * D].view(t, HKV, D)
    ik = fused[:, 2 * HKV * D:]
    slots = torch.randperm(p * PS, generator=gen)[:t]
    slots[[1, 5]] = -1  # padding tokens
    caches = [torch.randn(p, PS, HKV, D, generator=gen).to(dtype), torch.randn(p, PS, HKV, D, generator=gen).to(dtype),
              torch.randn(p, PS, DI, generator=gen).to(dtype)]
    expect = [c.clone() for c in caches]
    paged_kv.write_kv(k, v, ik, slots, *caches, backend="triton")
    paged_kv.write_kv_ref(k, v, ik, slots, *expect)
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
    # padding slots wrote nothing: the caches differ from their start only at the 7 real slots
    assert (caches[2].view(-1, DI) != expect[2].view(-1, DI)).sum() == 0


def test_write_kv_without_index_k_and_fp8_cache():
    gen = torch.Generator().manual_seed(2)
    t, p = 5, 3
    # values exactly representable in fp8 e4m3: the cast is then exact on every backend (the interpreter's own
    # fp32 -> fp8 rounding differs from torch's on some inputs, so random values are checked on the GPU)
    k = (torch.randint(-16, 17, (t, HKV, D), generator=gen) / 8.0)
    v = (torch.randint(-16, 17, (t, HKV, D), generator=gen) / 4.0)
    slots = torch.tensor([3, -1, 17, 40, 0])
    kc = torch.zeros(p, PS, HKV, D, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    paged_kv.write_kv(k, v, None, slots, kc, vc, None, backend="triton")
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    paged_kv.write_kv_ref(k, v, None, slots, kr, vr, None)
    assert torch.equal(kc.float(), kr.float()) and torch.equal(vc.float(), vr.float())
    assert kc.float().abs().sum() > 0


def test_gather_scatter_pages_roundtrip():
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(7, PS, HKV, D, generator=gen)
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    buf = paged_kv.gather_pages(cache, ids, backend="triton")
    assert torch.equal(buf, cache[ids.long()])
    data = torch.randn(3, PS, HKV, D, generator=gen)
    got, want = cache.clone(), cache.clone()
    paged_kv.scatter_pages(got, ids, data, backend="triton")
    paged_kv.scatter_pages_ref(want, ids, data)
    assert torch.equal(got, want)


def test_write_kv_rejects_bad_shapes():
    k = torch.randn(2, HKV, D)
    cache = torch.zeros(2, PS, HKV, D)
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_kv.write_kv(k, k, None, torch.zeros(3, dtype=torch.int64), cache, cache, None, backend="triton")


# ---------------------------------------------------------------- index_topk

# request 0: shorter than one block; 1: exactly 3 blocks (= topk below); 2: 5 blocks + 3 tokens.
# Several rows per request (verify rows) with their own positions.
_LENS = [7, 3 * PS, 5 * PS + 3]
_ROWS = [(0, 6), (1, 3 * PS - 1), (1, 3 * PS - 2), (2, 5 * PS + 2), (2, 4 * PS + 1), (2, PS)]


@pytest.mark.parametrize("fused,mode", [(True, None), (False, "rank"), (False, "rounds")])
@pytest.mark.parametrize("splits", [1, 2, 5, None])
def test_index_topk_matches_ref_at_every_split_count(paged_case, splits, fused, mode, nan_poison):
    poison_, _ = nan_poison
    case = paged_case(context_lens=_LENS, rows=_ROWS, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI, seed=4)
    q = torch.randn(len(_ROWS), 3, DI, generator=torch.Generator().manual_seed(5))
    for topk, local in ((3, 1), (4, 2)):
        want = itk.index_topk_ref(q, case.index_k_cache, case.page_tables, case.row_seq, case.positions, topk, local)
        out = poison_(torch.empty(len(_ROWS), 3, topk, dtype=torch.int32))
        # the unfused selections also write the chosen pages beside the ids (the -1 tail left as it was)
        pages = None if fused else poison_(torch.empty_like(out))
        itk.index_topk_decode(q, case.index_k_cache, case.page_tables, case.row_seq, case.positions, topk, local,
                              out=out, num_kv_splits=splits, fused=fused, select_mode=mode, pages_out=pages)
        assert torch.equal(out, want), (topk, local)
        if pages is not None:
            assert torch.equal(pages, _page_ids(want, case.page_tables, case.row_seq, tail=-(2**30))), (topk, local)
    assert (want == -1).any() and (want >= 0).any()  # the case covers padding and real picks


def test_index_topk_ties_go_to_the_lower_block(paged_case):
    # integer data: exact dot products, many equal block maxima
    gen = torch.Generator().manual_seed(6)
    case = paged_case(context_lens=[9 * PS + 5], rows=[(0, 9 * PS + 4), (0, 6 * PS)], page_size=PS, kv_heads=HKV,
                     head_dim=D, index_dim=DI, seed=7)
    ikc = torch.randint(0, 2, case.index_k_cache.shape, generator=gen).float()
    q = torch.ones(2, 2, DI)
    q[1, 1] = torch.randint(-1, 2, (DI,), generator=gen).float()
    want = itk.index_topk_ref(q, ikc, case.page_tables, case.row_seq, case.positions, 4, 1)
    for fused, mode in ((True, None), (False, "rank"), (False, "rounds")):
        got = itk.index_topk_decode(q, ikc, case.page_tables, case.row_seq, case.positions, 4, 1,
                                    num_kv_splits=3, fused=fused, select_mode=mode)
        assert torch.equal(got, want), (fused, mode)
    all_ones = torch.ones_like(ikc)
    want = itk.index_topk_ref(q, all_ones, case.page_tables, case.row_seq, case.positions, 4, 1)
    got = itk.index_topk(q, all_ones, case.page_tables, case.row_seq, case.positions, 4, 1, backend="triton")
    assert torch.equal(got, want)
    assert want[0, 0].tolist() == [0, 1, 2, 9]  # every score equal: lowest ids, plus the forced own block


def test_index_rank_selection_several_heads_per_program(paged_case, nan_poison):
    # one rank program for 2 of 3 heads (the third program half empty), local blocks forced, rows shorter than k
    poison_, _ = nan_poison
    case = paged_case(context_lens=_LENS, rows=_ROWS, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI, seed=18)
    q = torch.randn(len(_ROWS), 3, DI, generator=torch.Generator().manual_seed(19))
    args = (q, case.index_k_cache, case.page_tables, case.row_seq, case.positions)
    itk.SELECT["heads"] = 2
    try:
        for topk, local in ((4, 2), (2, 3)):
            want = itk.index_topk_ref(*args, topk, local)
            out = poison_(torch.empty(len(_ROWS), 3, topk, dtype=torch.int32))
            itk.index_topk_decode(*args, topk, local, out=out, num_kv_splits=2, select_mode="rank")
            assert torch.equal(out, want), (topk, local)
    finally:
        itk.SELECT["heads"] = 1


def test_index_topk_mixed_batch_and_fp16(paged_case):
    case = paged_case(context_lens=_LENS, rows=_ROWS, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI, seed=8,
                     dtype=torch.float16)
    q = torch.randn(len(_ROWS), 2, DI, generator=torch.Generator().manual_seed(9)).half()
    want = itk.index_topk_ref(q, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 3, 1)
    got = itk.index_topk(q, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 3, 1,
                         num_prefill_rows=2, backend="triton")
    assert torch.equal(got, want)


# ---------------------------------------------------------------- attention

def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _page_ids(block_ids, page_tables, row_seq, tail=10**6):
    """The selected blocks' pages as the indexer writes them beside block ids; `tail` in the -1 slots (a page far
    outside the cache: a kernel that read one there would fault or read garbage)."""
    table = page_tables.long()[row_seq.long()]  # [N, max_pages]
    pages = torch.gather(table[:, None, :].expand(-1, block_ids.shape[1], -1), 2, block_ids.clamp(min=0).long())
    return torch.where(block_ids >= 0, pages, tail).to(torch.int32)


@pytest.mark.parametrize("fold,preload,pages,swap", [(None, None, False, False), (True, False, False, False),
                                                      (False, True, False, False), (True, True, False, False),
                                                      (False, False, True, False), (None, True, True, False),
                                                      (None, None, False, True), (True, False, True, True)])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_sparse_attention_matches_ref_with_empty_splits(paged_case, splits, fold, preload, pages, swap, nan_poison):
    poison_, assert_all_written = nan_poison
    case = paged_case(context_lens=_LENS, rows=_ROWS, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI, seed=10)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(len(_ROWS), 2 * HKV, D, generator=gen)
    block_ids = itk.index_topk_ref(torch.randn(len(_ROWS), HKV, DI, generator=gen), case.index_k_cache,
                                   case.page_tables, case.row_seq, case.positions, 3, 1)
    # rows of request 0 select one block: with 4 splits, three of them are empty
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.3, block_ids)
    out = poison_(torch.empty_like(q))
    attention.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions,
                                     0.3, block_ids, out=out, num_splits=splits, fold_merge=fold, preload=preload,
                                     page_ids=_page_ids(block_ids, case.page_tables, case.row_seq) if pages else None,
                                     swap=swap)
    assert_all_written(out)
    assert _rel(out, want) < 1e-5
    from kernels._triton import _ARRIVAL_COUNTERS

    counters = _ARRIVAL_COUNTERS.get(("attention", out.device))  # the merging programs reset them
    assert counters is None or int(counters.abs().sum()) == 0


def test_sparse_programs_walking_several_blocks_take_the_walk_tile(paged_case, monkeypatch):
    # 32-token pages, walk tile 16: a program of 2 splits walks its blocks in half-page tiles, page ids preloaded
    ps = 32
    case = paged_case(context_lens=[5 * ps + 7, 2 * ps], rows=[(0, 5 * ps + 6), (0, 3 * ps), (1, 2 * ps - 1)],
                      page_size=ps, kv_heads=HKV, head_dim=D, index_dim=DI, seed=20)
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(3, 2 * HKV, D, generator=gen)
    block_ids = itk.index_topk_ref(torch.randn(3, HKV, DI, generator=gen), case.index_k_cache, case.page_tables,
                                   case.row_seq, case.positions, 4, 1)
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions, 0.3, block_ids)
    want = attention.paged_attention_ref(*args)
    launched = []
    real = attention.runnable

    class Spy:  # records the decode kernel's tile and preload as launched
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*a, **kw):
                launched.append((kw["BLOCK_N"], kw["PRELOAD"]))
                return self.kernel[grid](*a, **kw)
            return launch
    monkeypatch.setattr(attention, "runnable", lambda k, dev: Spy(real(k, dev)) if k is attention._decode_attn_kernel
                        else real(k, dev))
    monkeypatch.setitem(attention.ATTN_LAUNCH, "block_n", ps)
    monkeypatch.setitem(attention.ATTN_LAUNCH, "block_n_walk", ps // 2)
    for splits, tile in ((2, ps // 2), (4, ps)):  # 4 splits of 4 blocks: one tile a program keeps the page tile
        launched.clear()
        got = attention.paged_decode_attention(*args, num_splits=splits)
        assert launched == [(tile, True)], splits
        assert _rel(got, want) < 1e-5, splits


@pytest.mark.parametrize("splits,fold,swap", [(1, None, False), (3, None, False), (None, None, False),
                                              (3, True, False), (3, False, False), (1, None, True), (3, None, True)])
def test_dense_attention_matches_ref(paged_case, splits, fold, swap, nan_poison):
    poison_, assert_all_written = nan_poison
    case = paged_case(context_lens=_LENS, rows=_ROWS, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI, seed=12)
    q = torch.randn(len(_ROWS), 4 * HKV, D, generator=torch.Generator().manual_seed(13))
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq,
                                         case.positions, 0.25)
    out = poison_(torch.empty_like(q))
    attention.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions,
                                     0.25, out=out, num_splits=splits, fold_merge=fold, swap=swap)
    assert_all_written(out)
    assert _rel(out, want) < 1e-5


def test_attention_launchers_mixed_batch_fp16(paged_case):
    case = paged_case(context_lens=_LENS, rows=_ROWS, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI, seed=14,
                     dtype=torch.float16)
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(len(_ROWS), 2 * HKV, D, generator=gen).half()
    block_ids = itk.index_topk_ref(torch.randn(len(_ROWS), HKV, DI, generator=gen), case.index_k_cache.float(),
                                   case.page_tables, case.row_seq, case.positions, 2, 1)
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    want = attention.paged_attention_ref(*args, 0.25, block_ids)
    got = attention.sparse_attention(*args, block_ids, 0.25, num_prefill_rows=2, backend="triton")
    assert _rel(got, want) < 2e-3
    # the indexer's pages beside its ids, as the model passes them: the decode rows read them, prompt rows not
    qi = torch.randn(len(_ROWS), HKV, DI, generator=gen).half()
    ids, pages = itk.index_topk(qi, case.index_k_cache, case.page_tables, case.row_seq, case.positions, 2, 1,
                                num_prefill_rows=2, backend="triton", with_pages=True)
    assert torch.equal(pages[2:][ids[2:] >= 0], _page_ids(ids, case.page_tables, case.row_seq)[2:][ids[2:] >= 0])
    got = attention.sparse_attention(*args, ids, 0.25, num_prefill_rows=2, backend="triton", page_ids=pages)
    assert _rel(got, attention.paged_attention_ref(*args, 0.25, ids)) < 2e-3
    assert itk.index_topk(qi.float(), case.index_k_cache.float(), case.page_tables, case.row_seq, case.positions, 2,
                          1, with_pages=True)[1] is None  # the CPU serving path has no pages to give
    want = attention.paged_attention_ref(*args, 0.25)
    got = attention.dense_attention(*args, 0.25, num_prefill_rows=3, backend="triton")
    assert _rel(got, want) < 2e-3


def test_sparse_equals_dense_when_every_block_is_selected(paged_case):
    # with <= topk visible blocks a sparse layer is dense causal attention (M3_SPEC §3)
    case = paged_case(context_lens=[3 * PS + 2], rows=[(0, 3 * PS + 1), (0, 2 * PS)], page_size=PS, kv_heads=HKV,
                     head_dim=D, index_dim=DI, seed=16)
    q = torch.randn(2, 2 * HKV, D, generator=torch.Generator().manual_seed(17))
    block_ids = torch.tensor([[[0, 1, 2, 3]] * HKV, [[0, 1, 2, -1]] * HKV], dtype=torch.int32)
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    sparse = attention.sparse_attention(*args, block_ids, 0.25, backend="triton", num_splits=2)
    dense = attention.dense_attention(*args, 0.25, backend="triton", num_splits=2)
    assert _rel(sparse, dense) < 1e-6
