"""The work list of the block-major sparse prefill attention (kernels/prefill_sparse_split.py): every (row, KV head,
slot) pair of `block_ids` grouped by its segment key (kv head, request, block), built on the device with no host
sync.

`count_chunk` counts the pairs per key with atomics (the atomic's old value is the pair's slot in its segment)
into a buffer kept zeroed between calls; `scan_counts` (one program) turns the counts into segment starts and the
running count of programs (ceil(count / W) a segment) and zeroes the counts again; `scatter_chunk` puts every
pair at its segment slot and maps each program to its segment (a binary search over the program counts). The
order inside a segment is whatever the atomics gave: it changes no value, each partial being computed on its own
and merged by (row, slot). These pieces run as kernels of their own (`build_work_list`: the count kernel, whose
last program to arrive scans, then the scatter kernel) or inside the split's fused persistent kernel
(prefill_sparse_split.py). Hand-written: torch's sort-based grouping took 0.8 ms and a host sync (P7).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton import arrival_counters, runnable

CHUNK = 1024  # pairs per program of the count and scatter kernels (and per chunk of the fused kernel's phases)


@triton.jit
def _upper_bound(arr_ptr, x, lo, hi, want, steps):
    # per lane: the first index in [lo, hi) whose ascending arr value is > x (hi if none), in `steps` halvings
    for _ in range(steps):
        live = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(arr_ptr + mid, mask=live & want, other=0, cache_modifier=".cg") <= x
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & ~right, mid, hi)
    return lo


@triton.jit
def count_chunk(chunk, bid_ptr, qsl_ptr, cnt_ptr, key_ptr, rank_ptr, num_pairs, row0, num_requests, search_steps,
                width, bid_st_n, bid_st_h, HKV: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    # pairs p = (row * HKV + h) * TOPK + k of the slice: key[p] = (h, request, block) or -1, rank[p] = its slot
    p = chunk * BLOCK + tl.arange(0, BLOCK)
    inb = p < num_pairs
    row = p // (HKV * TOPK)
    h = (p // TOPK) % HKV
    blk = tl.load(bid_ptr + row.to(tl.int64) * bid_st_n + h * bid_st_h + p % TOPK, mask=inb, other=-1)
    ok = inb & (blk >= 0) & (blk < width)  # an id past the table would count outside the key space
    # the row's request: the first r in [1, R] with qsl[r] > row, less one (qsl[R] is past every prompt row)
    grow = row0 + row
    lo = _upper_bound(qsl_ptr, grow, tl.full([BLOCK], 1, tl.int32), tl.full([BLOCK], 0, tl.int32) + num_requests,
                      inb, search_steps)
    key = tl.where(ok, (h * num_requests + lo - 1) * width + blk, -1)
    rank = tl.atomic_add(cnt_ptr + key, 1, mask=ok)
    tl.store(key_ptr + p, key, mask=inb)
    tl.store(rank_ptr + p, rank, mask=ok)


# host ints that change from step to step are not specialised on (== 1, divisible by 16): no compile mid-serving
@triton.jit(do_not_specialize=["num_pairs", "row0", "num_requests", "search_steps", "width", "num_keys"])
def _count_kernel(bid_ptr, qsl_ptr, cnt_ptr, key_ptr, rank_ptr, seg_ptr, pend_ptr, num_pairs, row0, num_requests,
                  search_steps, width, num_keys, pairs_per_prog, bid_st_n, bid_st_h, HKV: tl.constexpr,
                  TOPK: tl.constexpr, BLOCK: tl.constexpr):
    count_chunk(tl.program_id(0), bid_ptr, qsl_ptr, cnt_ptr, key_ptr, rank_ptr, num_pairs, row0, num_requests,
                search_steps, width, bid_st_n, bid_st_h, HKV, TOPK, BLOCK)
    # the last program to arrive scans (one launch less: its host cost showed in PERF.md's single-call times,
    # docs/benchmarks.md P10). Every rank came back before the barrier, so this program's counts are in; the
    # release add publishes that, the acquire of the last arrival sees every program's. cnt[num_keys] is the
    # arrival counter, reset for the next call.
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + num_keys, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(cnt_ptr + num_keys, 0)
        scan_counts(cnt_ptr, seg_ptr, pend_ptr, num_keys, pairs_per_prog, BLOCK)


@triton.jit
def scan_counts(cnt_ptr, seg_ptr, pend_ptr, num_keys, pairs_per_prog, BLOCK: tl.constexpr):
    # one program: seg[k] = pairs of keys before k (exclusive scan, seg[num_keys] = all pairs), pend[k] =
    # programs of keys up to k (inclusive); the counts are zeroed for the next call. `.cg`: the counts were
    # written by other programs' atomics (L2), never through this SM's L1.
    seen = tl.zeros([1], tl.int32)
    progs = tl.zeros([1], tl.int32)
    for s in range(0, num_keys, BLOCK):
        k = s + tl.arange(0, BLOCK)
        live = k < num_keys
        c = tl.load(cnt_ptr + k, mask=live, other=0, cache_modifier=".cg")
        tl.store(cnt_ptr + k, tl.zeros([BLOCK], tl.int32), mask=live)
        pc = (c + pairs_per_prog - 1) // pairs_per_prog
        c_incl = tl.cumsum(c, 0)
        p_incl = tl.cumsum(pc, 0)
        tl.store(seg_ptr + k, seen + c_incl - c, mask=live)
        tl.store(pend_ptr + k, progs + p_incl, mask=live)
        seen += tl.sum(c, 0)
        progs += tl.sum(pc, 0)
    tl.store(seg_ptr + num_keys + tl.arange(0, 1), seen)


@triton.jit
def scatter_chunk(chunk, key_ptr, rank_ptr, seg_ptr, pend_ptr, perm_ptr, item_ptr, num_pairs, num_items, num_keys,
                   search_steps, BLOCK: tl.constexpr):
    # `.cg` reads: key / rank / the scan's output may come from other programs of the same launch (fused kernel)
    i = chunk * BLOCK + tl.arange(0, BLOCK)
    # pair i to its segment slot
    inb = i < num_pairs
    key = tl.load(key_ptr + i, mask=inb, other=-1, cache_modifier=".cg")
    ok = inb & (key >= 0)
    dst = (tl.load(seg_ptr + key, mask=ok, other=0, cache_modifier=".cg")
           + tl.load(rank_ptr + i, mask=ok, other=0, cache_modifier=".cg"))
    tl.store(perm_ptr + dst, i, mask=ok)
    # program i to its segment: the first key whose running program count passes i (-1 past the last program)
    want = i < num_items
    lo = _upper_bound(pend_ptr, i, tl.zeros([BLOCK], tl.int32), tl.zeros([BLOCK], tl.int32) + num_keys, want,
                      search_steps)
    tl.store(item_ptr + i, tl.where(lo < num_keys, lo, -1), mask=want)


@triton.jit(do_not_specialize=["num_pairs", "num_items", "num_keys", "search_steps"])
def _scatter_kernel(key_ptr, rank_ptr, seg_ptr, pend_ptr, perm_ptr, item_ptr, num_pairs, num_items, num_keys,
                    search_steps, BLOCK: tl.constexpr):
    scatter_chunk(tl.program_id(0), key_ptr, rank_ptr, seg_ptr, pend_ptr, perm_ptr, item_ptr, num_pairs, num_items,
                   num_keys, search_steps, BLOCK)


@dataclass(frozen=True)
class WorkList:
    """The device-built work list of one slice of rows (see the module docstring). Segment key =
    (kv head * num_requests + request) * width + block.

    seg_start [num_keys + 1] int32: each key's first slot in `perm` (key k's pairs: seg_start[k] ..
    seg_start[k + 1]); prog_end [num_keys] int32: programs of keys up to and including k; perm [num_pairs] int32:
    the pair index (row * Hkv + head) * K + slot at each segment slot; items [num_items] int32: each program's
    key, -1 past the end; num_items: the host bound of the grid."""

    seg_start: torch.Tensor
    prog_end: torch.Tensor
    perm: torch.Tensor
    items: torch.Tensor
    num_items: int
    pairs_per_prog: int
    num_requests: int
    width: int


@dataclass(frozen=True)
class WorkBuffers:
    """The device buffers one work list is built in (int32): counts [>= num_keys + 8] (zero at rest: the counts,
    then arrival and grid-sync counters), key / rank / perm [num_pairs], seg_start [num_keys + 1], prog_end
    [num_keys], items [num_items]."""

    counts: torch.Tensor
    key: torch.Tensor
    rank: torch.Tensor
    seg_start: torch.Tensor
    prog_end: torch.Tensor
    perm: torch.Tensor
    items: torch.Tensor
    num_pairs: int
    num_keys: int
    num_items: int


def work_buffers(num_pairs: int, num_keys: int, pairs_per_prog: int, device: torch.device) -> WorkBuffers:
    """Buffers for a work list of `num_pairs` pairs over `num_keys` segment keys; the grid bound num_items =
    ceil(pairs / W) + min(pairs, keys) (a segment's last program may hold fewer than W pairs)."""
    i32 = torch.int32
    counts = arrival_counters("prefill_split", num_keys + 8, device, 4096)
    if counts is None:  # (growing it under CUDA-graph capture: never for prompt rows, which run eager)
        counts = torch.zeros(num_keys + 8, dtype=i32, device=device)
    num_items = triton.cdiv(num_pairs, pairs_per_prog) + min(num_pairs, num_keys)
    e = functools.partial(torch.empty, dtype=i32, device=device)
    return WorkBuffers(counts, e(num_pairs), e(num_pairs), e(num_keys + 1), e(num_keys), e(num_pairs),
                       e(num_items), num_pairs, num_keys, num_items)


def build_work_list(block_ids: torch.Tensor, query_start_loc: torch.Tensor, row0: int, num_requests: int,
                    width: int, pairs_per_prog: int) -> WorkList:
    """block_ids [n, Hkv, K] int32 (rows row0 .. row0 + n - 1 of the prompt rows; -1: no block); query_start_loc
    [>= num_requests + 1] int32 over the prompt rows; width: the page tables' width in blocks (every selected id is
    below it). Two launches (the count kernel's last program scans), no host sync."""
    n, hkv, topk = block_ids.shape
    dev = block_ids.device
    buf = work_buffers(n * hkv * topk, hkv * num_requests * width, pairs_per_prog, dev)
    runnable(_count_kernel, dev)[(triton.cdiv(buf.num_pairs, CHUNK),)](
        block_ids, query_start_loc, buf.counts, buf.key, buf.rank, buf.seg_start, buf.prog_end, buf.num_pairs, row0,
        num_requests, max(1, num_requests.bit_length()), width, buf.num_keys, pairs_per_prog, block_ids.stride(0),
        block_ids.stride(1), HKV=hkv, TOPK=topk, BLOCK=CHUNK, num_warps=4)
    runnable(_scatter_kernel, dev)[(triton.cdiv(max(buf.num_pairs, buf.num_items), CHUNK),)](
        buf.key, buf.rank, buf.seg_start, buf.prog_end, buf.perm, buf.items, buf.num_pairs, buf.num_items,
        buf.num_keys, buf.num_keys.bit_length() + 1, BLOCK=CHUNK, num_warps=4)
    return WorkList(buf.seg_start, buf.prog_end, buf.perm, buf.items, buf.num_items, pairs_per_prog, num_requests,
                    width)


__all__ = ["CHUNK", "WorkBuffers", "WorkList", "build_work_list", "count_chunk", "scan_counts", "scatter_chunk",
           "work_buffers"]
