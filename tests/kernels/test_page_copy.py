"""kernels.page_copy: one launch moving pages of many caches (layers, K/V/index-K families, KV-head slices) to and
from one flat byte buffer. The Triton kernel runs in the CPU interpreter here and must equal the torch reference
bitwise; bytes outside the segments (buffer gaps, unlisted pages, heads outside a slice) must stay untouched."""
from __future__ import annotations

import pytest
import torch

from kernels.page_copy import (PageCopyPlan, gather_pages_into, gather_pages_into_ref, page_row_bytes,
                               scatter_pages_from, scatter_pages_from_ref)

POISON = 0xAB


def _caches(seed: int, *, pages=9, page_size=4, heads=3, dim=8, index_dim=8, dtype=torch.bfloat16):
    """Two layers of K/V [P, ps, H, D] and one index-K [P, ps, Di], random; plus head-slice views of the K/V."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    k = [rnd(pages, page_size, heads, dim) for _ in range(2)]
    v = [rnd(pages, page_size, heads, dim) for _ in range(2)]
    ik = rnd(pages, page_size, index_dim)
    return k, v, ik


def _views(k, v, ik, lo=1, hi=3):
    """Per layer: K and V narrowed to heads [lo, hi) (strided), then the index-K of layer 1 (contiguous)."""
    return [k[0][:, :, lo:hi], v[0][:, :, lo:hi], k[1][:, :, lo:hi], v[1][:, :, lo:hi], ik]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# These launch Triton on CPU tensors, which needs the interpreter (set without CUDA by tests/conftest.py); on a
# GPU machine Triton compiles for the GPU and the GPU test at the end covers the kernel.
interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-interpreter test; the GPU test covers CUDA")


@interpreter
def test_runs_layout_and_word_size():
    k, v, ik = _caches(0)
    plan = PageCopyPlan(_views(k, v, ik), 5, backend="triton")
    assert plan.fused and plan.word_dtype == torch.int64  # 2 heads x 8 x 2 B = 32 B runs: 8-byte words
    assert plan.rows == [4 * 2 * 8 * 2] * 4 + [4 * 8 * 2]
    odd = _caches(1, dim=3)[0][0][:, :, 1:2]  # runs of 3 bf16 = 6 B: 2-byte words
    assert PageCopyPlan([odd], 2, backend="triton").word_dtype == torch.int16
    perm = k[0].permute(0, 2, 1, 3)  # heads outermost within a page: not equal runs at one stride
    assert not PageCopyPlan([perm[:, :2]], 2, backend="triton").fused


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_equals_reference_with_ranges_offsets_and_gaps(dtype):
    k, v, ik = _caches(2, dtype=dtype)
    caches = _views(k, v, ik)
    ids = torch.tensor([7, 0, 3, 8, 2, 5], dtype=torch.int64)
    ranges = [(0, 6), (0, 6), (2, 6), (1, 4), (4, 6)]  # a chunk cut mid-piece, as plan_chunks does
    rows = [page_row_bytes(c) for c in caches]
    offsets, at = [], 16
    for (lo, hi), row in zip(ranges, rows):
        offsets.append(at)
        at += (hi - lo) * row + 24  # gaps that nobody may write
    want = torch.full((at,), POISON, dtype=torch.uint8)
    gather_pages_into_ref(caches, ids, want, ranges=ranges, offsets=offsets)
    got = torch.full((at,), POISON, dtype=torch.uint8)
    gather_pages_into(caches, ids, got, ranges=ranges, offsets=offsets, backend="triton")
    assert torch.equal(got, want)
    # the reference itself: segment 3 holds pages ids[1:4] of V[1] heads 1..2, densely
    seg = want[offsets[3]:offsets[3] + 3 * rows[3]].view(dtype).view(3, 4, 2, 8)
    assert torch.equal(_bytes(seg), _bytes(v[1][ids[1:4]][:, :, 1:3]))
    assert (want[:16] == POISON).all() and (want[offsets[1] - 24:offsets[1]] == POISON).all()
@interpreter
def test_scatter_writes_only_the_listed_pages_and_heads():
    k, v, ik = _caches(3)
    src_views = _views(k, v, ik)
    ids_src = torch.tensor([4, 1, 6], dtype=torch.int64)
    buf = torch.empty(sum(3 * page_row_bytes(c) for c in src_views), dtype=torch.uint8)
    gather_pages_into(src_views, ids_src, buf, backend="triton")

    dk, dv, dik = _caches(4)  # a different random cache: untouched bytes stay as they were
    before = [t.clone() for t in dk + dv + [dik]]
    ids_dst = torch.tensor([8, 2, 5], dtype=torch.int64)
    scatter_pages_from(_views(dk, dv, dik), ids_dst, buf, backend="triton")
    for d, s in zip(_views(dk, dv, dik), src_views):
        assert torch.equal(_bytes(d[ids_dst]), _bytes(s[ids_src]))
    others = [i for i in range(9) if i not in ids_dst.tolist()]
    for now, old in zip(dk + dv + [dik], before):
        assert torch.equal(_bytes(now[others]), _bytes(old[others]))  # unlisted pages
        if now.dim() == 4:
            assert torch.equal(_bytes(now[:, :, 0]), _bytes(old[:, :, 0]))  # head 0 is outside the slice

    ref_k, ref_v, ref_ik = [t.clone() for t in before[:2]], [t.clone() for t in before[2:4]], before[4].clone()
    scatter_pages_from_ref(_views(ref_k, ref_v, ref_ik), ids_dst, buf)
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(dk + dv + [dik], ref_k + ref_v + [ref_ik]))
@interpreter
def test_scatter_skips_negative_page_ids():
    """A batched KV transfer drops a refused request's rows by giving them page id -1: nothing is written for
    them, the other rows land as usual (kernel and reference alike)."""
    k, v, ik = _caches(3)
    src_views = _views(k, v, ik)
    ids_src = torch.tensor([4, 1, 6, 0], dtype=torch.int64)
    buf = torch.empty(sum(4 * page_row_bytes(c) for c in src_views), dtype=torch.uint8)
    gather_pages_into(src_views, ids_src, buf, backend="triton")
    ids_dst = torch.tensor([8, -1, 5, -1], dtype=torch.int64)
    for backend in ("triton", "ref"):
        dk, dv, dik = _caches(4)
        before = [t.clone() for t in dk + dv + [dik]]
        scatter_pages_from(_views(dk, dv, dik), ids_dst, buf, backend=backend)
        for d, s in zip(_views(dk, dv, dik), src_views):
            assert torch.equal(_bytes(d[[8, 5]]), _bytes(s[[4, 6]])), backend
        others = [i for i in range(9) if i not in (8, 5)]
        for now, old in zip(dk + dv + [dik], before):
            assert torch.equal(_bytes(now[others]), _bytes(old[others])), backend


@interpreter
def test_rows_split_over_several_programs_and_narrow_words():
    """Rows larger than one loop step split over grid z (and a partial last part); 2-byte words on odd dims."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(5, 16, 2, 160, generator=gen)  # 20 KiB pages: 2560 words of 8 B -> 3 parts of 1024
    odd = torch.randn(5, 4, 3, 3, generator=gen).to(torch.bfloat16)[:, :, 1:3]
    ids = torch.tensor([3, 1], dtype=torch.int64)
    for caches in ([big], [odd], [big, odd]):
        plan = PageCopyPlan(caches, 2, backend="triton")
        assert plan.fused
        got = torch.full((plan.nbytes,), POISON, dtype=torch.uint8)
        plan.gather(ids, got)
        want = torch.full((plan.nbytes,), POISON, dtype=torch.uint8)
        gather_pages_into_ref(caches, ids, want)
        assert torch.equal(got, want)
    assert PageCopyPlan([big], 2, backend="triton").grid == (1, 2, 3)
    assert PageCopyPlan([odd], 2, backend="triton").word_dtype == torch.int16
@interpreter
def test_plan_is_reused_for_other_page_ids_and_checks_inputs():
    k, v, ik = _caches(6)
    caches = _views(k, v, ik)
    plan = PageCopyPlan(caches, 3, backend="triton")
    for ids in ([0, 1, 2], [8, 7, 6]):
        t = torch.tensor(ids, dtype=torch.int32)  # int32 ids are accepted
        got, want = torch.zeros(plan.nbytes, dtype=torch.uint8), torch.zeros(plan.nbytes, dtype=torch.uint8)
        plan.gather(t, got)
        gather_pages_into_ref(caches, t, want)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="3 page ids"):
        plan.gather(torch.tensor([0, 1]), torch.zeros(plan.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds"):
        plan.gather(torch.tensor([0, 1, 2]), torch.zeros(plan.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        plan.gather(torch.tensor([0, 1, 2]), torch.zeros(plan.nbytes, dtype=torch.int32))
    with pytest.raises(ValueError, match="outside"):
        PageCopyPlan(caches, 3, ranges=[(0, 4)] * 5)
    empty = PageCopyPlan(caches, 0, backend="triton")  # a zero-page plan moves nothing
    empty.gather(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_one_launch_equals_reference_at_m3_slice_shapes():
    """m3-slice pages (128 tokens, 4 KV heads x 128, bf16; index-K 128), head slices, shuffled ids, compiled."""
    import kernels.page_copy as pc

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = [torch.randn(64, 128, 4, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4)]
    ik = [torch.randn(64, 128, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    for views in ([*k, *ik], [t[:, :, 1:3] for t in k] + ik[:1]):
        ids = torch.randperm(64, generator=gen, device="cuda")[:40]
        plan = PageCopyPlan(views, 40)
        assert plan.fused, pc.triton_failure
        got = torch.empty(plan.nbytes, dtype=torch.uint8, device="cuda")
        plan.gather(ids, got)
        want = torch.empty_like(got)
        gather_pages_into_ref(views, ids, want)
        assert torch.equal(got, want)
        dst = [torch.zeros(t.shape[0], *t.shape[1:], dtype=t.dtype, device="cuda") for t in views]
        PageCopyPlan(dst, 40).scatter(ids, got)
        assert all(torch.equal(d[ids], s[ids].contiguous()) for d, s in zip(dst, views))
        # every third row dropped (page id -1, a refused request of a batch): those pages stay zero
        dropped = ids.clone()
        dropped[::3] = -1
        dst = [torch.zeros_like(d) for d in dst]
        PageCopyPlan(dst, 40).scatter(dropped, got)
        kept = dropped[dropped >= 0]
        assert all(torch.equal(d[kept], s[kept].contiguous()) for d, s in zip(dst, views))
        assert all(not d[ids[::3]].any() for d in dst)
        assert pc.triton_failure is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_reused_plan_launches_directly_with_device_or_pinned_host_ids():
    """After its first (JIT) launch a plan launches the compiled kernel itself; page ids may sit in pinned host
    memory (the transfer sender's). Every launch, for new ids and both directions, equals the reference; a
    buffer of other alignment goes back through the JIT (its specialisation differs)."""
    import kernels.page_copy as pc

    gen = torch.Generator(device="cuda").manual_seed(1)
    views = [torch.randn(48, 128, 4, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    plan = PageCopyPlan(views, 20)
    assert plan.fused, pc.triton_failure
    raw = torch.empty(plan.nbytes + 8, dtype=torch.uint8, device="cuda")
    for rep in range(4):
        ids = torch.randperm(48, generator=gen, device="cuda")[:20]
        src = ids.cpu().pin_memory() if rep % 2 else ids
        got = torch.full((plan.nbytes,), 7, dtype=torch.uint8, device="cuda")
        plan.gather(src, got)
        want = torch.empty_like(got)
        gather_pages_into_ref(views, ids, want)
        assert torch.equal(got, want), rep
        assert True in plan._compiled  # compiled once, launched directly from the second call on
        dst = [torch.zeros_like(v) for v in views]
        PageCopyPlan(dst, 20).scatter(src, got)
        assert all(torch.equal(d[ids], v[ids]) for d, v in zip(dst, views)), rep
    odd = raw[8:8 + plan.nbytes]  # 8-byte aligned, not 16: another specialisation, through the JIT
    plan.gather(ids, odd)
    assert torch.equal(odd, want)
    assert pc.triton_failure is None
