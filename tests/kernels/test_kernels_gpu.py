"""Triton kernels vs their torch references on the GPU at the real M3 shapes (bf16; fp8 cache writes)."""
from __future__ import annotations

import pytest
import torch

from kernels import attention, index_topk as itk, paged_kv

pytestmark = pytest.mark.gpu

PS, HKV, HQ, D, HI, DI, TOPK = 128, 4, 64, 128, 4, 128, 16


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _decode_case(make, batch, length, seed, rows_per_request=1):
    # lengths around `length`, not multiples of the page size; verify rows sit at the last positions
    g = torch.Generator().manual_seed(seed)
    lens = [length - int(x) for x in torch.randint(0, 100, (batch,), generator=g)]
    lens = [n + 1 if n % PS == 0 else n for n in lens]
    rows = [(r, lens[r] - 1 - j) for r in range(batch) for j in range(rows_per_request)]
    return make(context_lens=lens, rows=rows, page_size=PS, kv_heads=HKV, head_dim=D, index_dim=DI,
                     dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_write_kv_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    t, p = 64, 200
    k = torch.randn(t, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(t, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    ik = torch.randn(t, DI, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = torch.randperm(p * PS, device="cuda", generator=g)[:t]
    slots[::7] = -1
    caches = [torch.randn(p, PS, HKV, D, device="cuda", generator=g).to(dtype),
              torch.randn(p, PS, HKV, D, device="cuda", generator=g).to(dtype),
              torch.randn(p, PS, DI, device="cuda", generator=g).to(dtype)]
    expect = [c.clone() for c in caches]
    paged_kv.write_kv(k, v, ik, slots, *caches)
    paged_kv.write_kv_ref(k, v, ik, slots, *expect)
    for got, want in zip(caches, expect):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_gather_scatter_gpu():
    cache = torch.randn(300, PS, HKV, D, device="cuda").bfloat16()
    ids = torch.randperm(300, device="cuda")[:37]
    buf = paged_kv.gather_pages(cache, ids)
    assert torch.equal(buf, cache[ids])
    data = torch.randn_like(buf)
    want = cache.clone()
    want[ids] = data
    paged_kv.scatter_pages(cache, ids, data)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("batch,length,rows_per_request", [(1, 8700, 1), (16, 8700, 1), (4, 20000, 3)])
def test_index_topk_gpu(paged_case, batch, length, rows_per_request):
    case = _decode_case(paged_case, batch, length, seed=batch, rows_per_request=rows_per_request)
    n = case.row_seq.numel()
    q = torch.randn(n, HI, DI, device="cuda").bfloat16()
    args = (q, case.index_k_cache, case.page_tables, case.row_seq, case.positions, TOPK, 1)
    want = itk.index_topk_ref(*args)
    for splits, fused, mode in ((1, None, None), (4, True, None), (None, True, None), (None, False, "rank"),
                                (None, False, "rounds"), (3, False, "rank")):
        got = itk.index_topk_decode(*args, num_kv_splits=splits, fused=fused, select_mode=mode)
        assert torch.equal(got, want), (splits, fused, mode)
    # the fused path's arrival counters are left at zero: repeated calls see the same result
    for _ in range(3):
        assert torch.equal(itk.index_topk(*args, fused=True), want)


@pytest.mark.parametrize("batch,length,rows_per_request", [(1, 3000, 1), (16, 8700, 1), (4, 9000, 3)])
def test_attention_gpu(paged_case, batch, length, rows_per_request):
    case = _decode_case(paged_case, batch, length, seed=10 + batch, rows_per_request=rows_per_request)
    n = case.row_seq.numel()
    q = torch.randn(n, HQ, D, device="cuda").bfloat16()
    qi = torch.randn(n, HKV, DI, device="cuda").bfloat16()
    block_ids = itk.index_topk_ref(qi, case.index_k_cache, case.page_tables, case.row_seq, case.positions, TOPK, 1)
    args = (q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, case.positions)
    want = attention.paged_attention_ref(*args, D ** -0.5, block_ids)
    for splits in (1, 5, None):
        assert _rel(attention.sparse_attention(*args, block_ids, D ** -0.5, num_splits=splits), want) < 1e-2
    table = case.page_tables.long()[case.row_seq.long()]
    pages = torch.gather(table[:, None, :].expand(-1, HKV, -1), 2, block_ids.clamp(min=0).long())
    page_ids = torch.where(block_ids >= 0, pages, 10**6).to(torch.int32)  # a -1 slot's page is never read
    for splits, fold, pre, pids, swap in ((5, True, False, None, None), (None, True, True, None, None),
                                          (16, True, True, None, None), (None, False, True, None, None),
                                          (None, None, None, page_ids, None), (4, False, False, page_ids, None),
                                          (16, False, True, page_ids, None), (None, None, None, None, True),
                                          (4, True, None, page_ids, True), (16, False, True, None, True)):
        # the merge folded into the last split is deterministic: repeated calls are bitwise equal
        got = [attention.paged_decode_attention(*args, D ** -0.5, block_ids, num_splits=splits, fold_merge=fold,
                                                preload=pre, page_ids=pids, swap=swap) for _ in range(3)]
        cfg = (splits, fold, pre, pids is not None, swap)
        assert _rel(got[0], want) < 1e-2, cfg
        assert all(torch.equal(g, got[0]) for g in got), cfg
    want = attention.paged_attention_ref(*args, D ** -0.5)
    assert _rel(attention.dense_attention(*args, D ** -0.5), want) < 1e-2
    assert _rel(attention.paged_decode_attention(*args, D ** -0.5, fold_merge=True, num_splits=7), want) < 1e-2
    assert _rel(attention.paged_decode_attention(*args, D ** -0.5, num_splits=7, swap=True), want) < 1e-2
    # mixed batch: the first row goes through the prefill kernel (a one-token chunk), the rest the decode kernel
    assert _rel(attention.dense_attention(*args, D ** -0.5, num_prefill_rows=1), want) < 1e-2


def test_decode_step_captures_in_a_cuda_graph(paged_case):
    # write -> index top-k -> sparse attention, captured once, replayed on new inputs written into the same buffers
    case = _decode_case(paged_case, 8, 5000, seed=3)
    n = case.row_seq.numel()
    k_new = torch.empty(n, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_new, ik_new = torch.empty_like(k_new), torch.empty(n, DI, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(n, HQ, D, device="cuda", dtype=torch.bfloat16)
    qi = torch.empty(n, HI, DI, device="cuda", dtype=torch.bfloat16)
    pos = case.positions
    slots = case.page_tables[case.row_seq.long(), pos // PS].long() * PS + pos % PS

    def step():
        paged_kv.write_kv(k_new, v_new, ik_new, slots, case.k_cache, case.v_cache, case.index_k_cache)
        ids = itk.index_topk(qi, case.index_k_cache, case.page_tables, case.row_seq, pos, TOPK, 1)
        return ids, attention.sparse_attention(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, pos,
                                               ids, D ** -0.5)

    for x in (k_new, v_new, ik_new, q, qi):
        x.normal_()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_out, attn_out = step()
    for x in (k_new, v_new, ik_new, q, qi):
        x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(case.k_cache.view(-1, HKV, D)[slots], k_new)
    want_ids = itk.index_topk_ref(qi, case.index_k_cache, case.page_tables, case.row_seq, pos, TOPK, 1)
    assert torch.equal(ids_out, want_ids)
    want = attention.paged_attention_ref(q, case.k_cache, case.v_cache, case.page_tables, case.row_seq, pos,
                                         D ** -0.5, want_ids)
    assert _rel(attn_out, want) < 1e-2


@pytest.mark.parametrize("shape", [(8192, HQ, D), (300, HKV, D), (8192, DI)])
def test_qk_norm_rope_gpu(shape):
    from kernels.rope import qk_norm_rope, qk_norm_rope_ref

    g = torch.Generator(device="cuda").manual_seed(len(shape))
    x = torch.randn(*shape, device="cuda", generator=g).bfloat16()
    w = (torch.randn(shape[-1], device="cuda", generator=g) * 0.1).bfloat16()
    pos = torch.randint(0, 1 << 20, (shape[0],), device="cuda", generator=g).float()
    inv = 1.0 / (5e6 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = emb.cos(), emb.sin()
    got, want = qk_norm_rope(x, w, 1e-6, cos, sin), qk_norm_rope_ref(x, w, 1e-6, cos, sin)
    assert _rel(got, want) < 1e-2
    # the same rounding steps as the unfused path: nearly every element bitwise equal
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_router_select_gpu(rows):
    """The fused router selection against torch's sigmoid / top-k / renormalise on M3's 128 experts, top-8: the
    same experts in the same order (rows whose k-th and (k+1)-th biased scores are closer than 1e-6 may differ:
    sigmoid's last bit), weights within fp32 rounding; it captures in a CUDA graph."""
    from kernels.router import router_select, router_select_ref

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 128, device="cuda", generator=g) * 2
    bias = torch.randn(128, device="cuda", generator=g) * 0.05
    want_ids, want_w = router_select_ref(logits, bias, 8, 2.5)
    ids, w = router_select(logits, bias, 8, 2.5)
    top9 = torch.topk(torch.sigmoid(logits) + bias, 9, dim=-1).values
    near_tie = (top9[:, 7] - top9[:, 8]) < 1e-6
    same = (ids == want_ids).all(-1)
    assert bool((same | near_tie).all()) and same.float().mean() > 0.99
    torch.testing.assert_close(w[same], want_w[same], rtol=2e-6, atol=1e-7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gw = router_select(logits, bias, 8, 2.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gids, ids) and torch.equal(gw, w)
