"""Whole-page copies between many paged caches and ONE flat staging buffer, in one launch (the KV transfer path).

A KV transfer chunk holds pages of every layer and both page families (K, V, index-K), possibly a KV-head slice of
each K/V cache. Copying them with one kernel per (layer, family) costs ~11 launches per chunk per side, each
10-40 us of host time; here a small table (one row per segment) describes every piece and one launch moves them
all. Bytes are moved as they are (no dtype cast): the staging buffer is raw bytes.

Segment i: pages `page_ids[lo_i:hi_i]` of `caches[i]` <-> bytes `[offset_i, offset_i + (hi_i - lo_i) * row_i)` of the
buffer, page after page, each page as a dense row of `row_i` bytes (`row_i` = the page's elements x element size).
A cache is [num_pages, ...] with any strides whose page (all dims but the first) is "runs": equal contiguous runs
at a constant stride (e.g. K[:, :, h0:h1] of a [P, page_size, Hkv, D] cache: page_size runs of (h1 - h0) * D).

`PageCopyPlan` holds the table on the device, so a transfer of a known shape reuses it (no host-to-device copy per
chunk); `gather_pages_into` / `scatter_pages_from` build one and run it. The `*_ref` functions are the torch
reference (one index_select / index_copy_ per segment), used on CPU tensors unless the backend is forced.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels._triton import launch_hooks_set, num_sms, runnable, use_triton

_FIELDS = 8  # table row: cache address, first page-id index, pages, page stride, runs, run length, run stride, offset
_BLOCK = 1024  # words per loop step of one program
# why the Triton path stopped being used in this process (a failed compile or launch), else None; the plans
# then run the reference, and `PageCopyPlan.fused` says so (the transfer benchmark prints it)
triton_failure: str | None = None


@triton.jit
def _page_copy_kernel(table_ptr, ids_ptr, buf_ptr, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    # program (s, j, c): part c of page j of segment s. All lengths and strides are in words of buf's type.
    s = tl.program_id(0)
    j = tl.program_id(1)
    c = tl.program_id(2)
    row = table_ptr + s * 8
    n_pages = tl.load(row + 2)
    if j < n_pages:
        cache_addr = tl.load(row + 0)
        ids_lo = tl.load(row + 1)
        page_stride = tl.load(row + 3)
        n_runs = tl.load(row + 4)
        run_len = tl.load(row + 5)
        run_stride = tl.load(row + 6)
        buf_off = tl.load(row + 7)
        page = tl.load(ids_ptr + ids_lo + j)
        cache = cache_addr.to(buf_ptr.dtype) + page * page_stride  # the page's first word in the cache
        row_len = n_runs * run_len
        per = tl.cdiv(tl.cdiv(row_len, tl.num_programs(2)), BLOCK) * BLOCK
        lo = c * per
        hi = tl.minimum(lo + per, row_len)
        if not GATHER:  # a negative page id: that row of the buffer is not written anywhere (a refused request)
            hi = tl.where(page < 0, lo, hi)
        buf = buf_ptr + buf_off + j * row_len
        run_len32 = run_len.to(tl.int32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            offs32 = offs.to(tl.int32)  # within one page: a 32-bit division is much cheaper than a 64-bit one
            run = offs32 // run_len32
            cache_offs = run.to(tl.int64) * run_stride + (offs32 - run * run_len32)
            if GATHER:
                x = tl.load(cache + cache_offs, mask=mask)
                tl.store(buf + offs, x, mask=mask)
            else:
                x = tl.load(buf + offs, mask=mask)
                tl.store(cache + cache_offs, x, mask=mask)


def _aligned(ptr: int) -> bool:
    """What Triton specialises a pointer argument on (16-byte divisibility)."""
    return ptr % 16 == 0


def page_row_bytes(cache: torch.Tensor) -> int:
    """Bytes of one page of `cache` [num_pages, ...] as a dense row."""
    return math.prod(cache.shape[1:]) * cache.element_size()


def _runs(cache: torch.Tensor) -> tuple[int, int, int] | None:
    """(runs, run elements, run stride in elements) of one page of `cache`, or None if not of that form."""
    shape, strides = list(cache.shape[1:]), list(cache.stride()[1:])
    run, expect = 1, 1
    while shape and (shape[-1] == 1 or strides[-1] == expect):  # the contiguous tail of the page
        run *= shape[-1]
        expect *= shape[-1]
        shape.pop(), strides.pop()
    outer = [(n, st) for n, st in zip(shape, strides) if n != 1]
    if not outer:
        return 1, run, run
    for (n_a, st_a), (_n_b, st_b) in zip(outer, outer[1:]):  # the leading dims must fold into one strided dim
        if st_a != st_b * _n_b:
            return None
    return math.prod(n for n, _ in outer), run, outer[-1][1]


def _segments(caches, ranges, offsets, num_ids: int) -> tuple[list, list, list]:
    if ranges is None:
        ranges = [(0, num_ids)] * len(caches)
    if len(ranges) != len(caches):
        raise ValueError(f"page_copy: {len(caches)} caches but {len(ranges)} page ranges")
    rows = [page_row_bytes(c) for c in caches]
    if offsets is None:
        offsets, at = [], 0
        for row, (lo, hi) in zip(rows, ranges):
            offsets.append(at)
            at += (hi - lo) * row
    if len(offsets) != len(caches):
        raise ValueError(f"page_copy: {len(caches)} caches but {len(offsets)} offsets")
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= num_ids:
            raise ValueError(f"page_copy: page range [{lo}, {hi}) outside the {num_ids} page ids")
    return list(ranges), list(offsets), rows


def _check_buffer(buf: torch.Tensor, need: int, what: str) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{what}: the buffer must be a contiguous uint8 [nbytes], got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    if buf.numel() < need:
        raise ValueError(f"{what}: the buffer holds {buf.numel()} bytes, the segments need {need}")


def _check_ids(page_ids: torch.Tensor, what: str) -> None:
    if page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: page_ids must be int [n], got {page_ids.dtype} {tuple(page_ids.shape)}")


# ---- torch reference ---------------------------------------------------------------------------------------
def gather_pages_into_ref(caches: Sequence[torch.Tensor], page_ids: torch.Tensor, out: torch.Tensor, *,
                          ranges: Sequence[tuple[int, int]] | None = None,
                          offsets: Sequence[int] | None = None) -> None:
    """out (uint8 [nbytes]) bytes [offset_i, ...) <- pages page_ids[lo_i:hi_i] of caches[i], as dense rows."""
    ranges, offsets, rows = _segments(caches, ranges, offsets, page_ids.numel())
    _check_buffer(out, max((o + (hi - lo) * r for o, (lo, hi), r in zip(offsets, ranges, rows)), default=0),
                  "gather_pages_into")
    ids = page_ids.to(torch.long)
    for cache, (lo, hi), off, row in zip(caches, ranges, offsets, rows):
        n = hi - lo
        dst = out[off:off + n * row].view(cache.dtype).view(n, *cache.shape[1:])
        # index_select writes into the slice directly, also from a strided (head-narrowed) cache view
        torch.index_select(cache, 0, ids[lo:hi], out=dst)


def scatter_pages_from_ref(caches: Sequence[torch.Tensor], page_ids: torch.Tensor, src: torch.Tensor, *,
                           ranges: Sequence[tuple[int, int]] | None = None,
                           offsets: Sequence[int] | None = None) -> None:
    """Pages page_ids[lo_i:hi_i] of caches[i] <- src (uint8 [nbytes]) bytes [offset_i, ...) (the reverse). A
    negative page id skips its row (the receiver of a batch drops a refused request's rows that way)."""
    ranges, offsets, rows = _segments(caches, ranges, offsets, page_ids.numel())
    _check_buffer(src, max((o + (hi - lo) * r for o, (lo, hi), r in zip(offsets, ranges, rows)), default=0),
                  "scatter_pages_from")
    ids = page_ids.to(torch.long)
    for cache, (lo, hi), off, row in zip(caches, ranges, offsets, rows):
        n = hi - lo
        data = src[off:off + n * row].view(cache.dtype).view(n, *cache.shape[1:])
        keep = ids[lo:hi] >= 0
        if bool(keep.all()):
            cache.index_copy_(0, ids[lo:hi], data)
        else:
            cache.index_copy_(0, ids[lo:hi][keep], data[keep])


# ---- the one-launch plan -----------------------------------------------------------------------------------
class PageCopyPlan:
    """The segments of one chunk, fixed once (cache views, page ranges into the page-id list, buffer offsets);
    `gather(page_ids, out)` / `scatter(page_ids, src)` run it for any page ids of that length.

    backend None: one Triton launch on CUDA, the torch reference elsewhere; "triton" / "ref" force one (Triton on
    CPU tensors needs the interpreter). Caches whose pages are not "runs" fall back to the reference.
    """

    def __init__(self, caches: Sequence[torch.Tensor], num_ids: int, *,
                 ranges: Sequence[tuple[int, int]] | None = None, offsets: Sequence[int] | None = None,
                 backend: str | None = None) -> None:
        if not caches:
            raise ValueError("page_copy: no caches")
        self.caches = list(caches)
        self.num_ids = num_ids
        self.ranges, self.offsets, self.rows = _segments(self.caches, ranges, offsets, num_ids)
        self.nbytes = max(o + (hi - lo) * r for o, (lo, hi), r in zip(self.offsets, self.ranges, self.rows))
        self.device = self.caches[0].device
        if any(c.device != self.device for c in self.caches):
            raise ValueError("page_copy: caches on several devices")
        runs = [_runs(c) for c in self.caches]
        self.forced = backend == "triton"  # tests: a kernel failure must surface, never fall back
        self.fused = (use_triton(self.device, backend) and all(r is not None for r in runs)
                      and (self.forced or triton_failure is None))
        if not self.fused:
            return
        # the widest word (<= 8 bytes) that divides every address, stride, run and offset
        sizes = []
        for c, (n_runs, run, stride), off in zip(self.caches, runs, self.offsets):
            es = c.element_size()
            sizes += [c.data_ptr(), c.stride(0) * es, run * es, stride * es, off]
        word = 8
        while word > 1 and any(x % word for x in sizes):
            word //= 2
        self.word_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        table = []
        for c, (n_runs, run, stride), (lo, hi), off in zip(self.caches, runs, self.ranges, self.offsets):
            es = c.element_size()
            table.append([c.data_ptr(), lo, hi - lo, c.stride(0) * es // word, n_runs, run * es // word,
                          stride * es // word, off // word])
        self.table = torch.tensor(table, dtype=torch.int64).to(self.device)
        max_pages = max(hi - lo for lo, hi in self.ranges)
        max_row = max(self.rows) // word
        # enough programs to fill the device (~4 per SM), never more parts than BLOCK-sized pieces of a row
        progs = len(self.caches) * max(max_pages, 1)
        splits = max(1, min(triton.cdiv(4 * num_sms(self.device), progs), triton.cdiv(max_row, _BLOCK)))
        self.grid = (len(self.caches), max_pages, splits)
        # GATHER -> the compiled kernel, launched directly after its first (JIT) launch: the JIT's argument
        # binding and cache lookup cost ~15 us of host time per launch on the H200 host, on the transfer's
        # critical path on both sides; the direct launch ~5 us
        self._compiled: dict[bool, object] = {}

    def _run(self, page_ids: torch.Tensor, buf: torch.Tensor, gather: bool, what: str) -> None:
        _check_ids(page_ids, what)
        if page_ids.numel() != self.num_ids:
            raise ValueError(f"{what}: the plan is for {self.num_ids} page ids, got {page_ids.numel()}")
        _check_buffer(buf, self.nbytes, what)
        # page ids in pinned host memory: the kernel reads them over the bus (no upload launch on the host's
        # critical path); the reference needs them on the device
        host_ids = self.device.type == "cuda" and page_ids.device.type == "cpu" and page_ids.is_pinned()

        def reference() -> None:
            ids = page_ids.to(self.device, non_blocking=True) if host_ids else page_ids
            fn = gather_pages_into_ref if gather else scatter_pages_from_ref
            fn(self.caches, ids, buf, ranges=self.ranges, offsets=self.offsets)

        if not self.fused:
            reference()
            return
        if (page_ids.device != self.device and not host_ids) or buf.device != self.device:
            raise ValueError(f"{what}: page_ids (or pinned host ids) and buffer must be on {self.device}")
        if buf.data_ptr() % self.word_dtype.itemsize:  # a misaligned slice of a larger buffer: bytewise is wrong
            reference()
            return
        if self.grid[1] == 0:
            return
        words = buf[:self.nbytes].view(self.word_dtype)
        ids = page_ids if page_ids.dtype == torch.int64 else page_ids.to(torch.int64)
        ids = ids.contiguous()
        if self._launch_compiled(gather, ids.data_ptr(), words.data_ptr()):
            return
        try:
            kernel = runnable(_page_copy_kernel, self.device)[self.grid](self.table, ids, words, GATHER=gather,
                                                                         BLOCK=_BLOCK, num_warps=4)
            if self.device.type == "cuda" and hasattr(kernel, "run"):
                self._compiled[gather] = (kernel, _aligned(ids.data_ptr()), _aligned(words.data_ptr()))
        except Exception as exc:  # a compile/launch failure (not a data error: nothing ran): keep moving pages
            if self.forced:
                raise
            global triton_failure
            triton_failure = f"{type(exc).__name__}: {str(exc)[:300]}"
            warnings.warn(f"page_copy: the Triton copy failed, using torch per segment: {triton_failure}",
                          RuntimeWarning, stacklevel=2)
            self.fused = False
            reference()

    def _launch_compiled(self, gather: bool, ids_ptr: int, words_ptr: int) -> bool:
        """Launch the kernel compiled by an earlier call straight through its launcher; False when there is none
        yet or the pointers' alignment differs from what it was specialised for (the JIT then picks the
        variant)."""
        entry = self._compiled.get(gather)
        if entry is None:
            return False
        kernel, ids_aligned, words_aligned = entry
        if _aligned(ids_ptr) != ids_aligned or _aligned(words_ptr) != words_aligned:
            return False
        if launch_hooks_set():  # a profiler listens: let the JIT build the metadata it expects
            return False
        g0, g1, g2 = self.grid
        kernel.run(g0, g1, g2, torch.cuda.current_stream(self.device).cuda_stream, kernel.function,
                   kernel.packed_metadata, None, None, None, self.table.data_ptr(), ids_ptr, words_ptr, gather,
                   _BLOCK)
        return True

    def gather(self, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        self._run(page_ids, out, True, "gather_pages_into")

    def scatter(self, page_ids: torch.Tensor, src: torch.Tensor) -> None:
        self._run(page_ids, src, False, "scatter_pages_from")


def gather_pages_into(caches: Sequence[torch.Tensor], page_ids: torch.Tensor, out: torch.Tensor, *,
                      ranges: Sequence[tuple[int, int]] | None = None, offsets: Sequence[int] | None = None,
                      backend: str | None = None) -> None:
    """Copy pages `page_ids[lo_i:hi_i]` of every `caches[i]` into `out` (uint8 [nbytes]) at byte `offsets[i]`
    (default: all ids for every cache, segments back to back), in one launch on CUDA."""
    PageCopyPlan(caches, page_ids.numel(), ranges=ranges, offsets=offsets, backend=backend).gather(page_ids, out)


def scatter_pages_from(caches: Sequence[torch.Tensor], page_ids: torch.Tensor, src: torch.Tensor, *,
                       ranges: Sequence[tuple[int, int]] | None = None, offsets: Sequence[int] | None = None,
                       backend: str | None = None) -> None:
    """The reverse of `gather_pages_into`: write `src`'s rows into the listed pages of every cache."""
    PageCopyPlan(caches, page_ids.numel(), ranges=ranges, offsets=offsets, backend=backend).scatter(page_ids, src)


__all__ = ["PageCopyPlan", "gather_pages_into", "scatter_pages_from", "gather_pages_into_ref",
           "scatter_pages_from_ref", "page_row_bytes"]
