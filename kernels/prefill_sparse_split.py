"""Block-major MSA sparse prefill attention: each selected K/V block is read once for the many tokens that chose it.

`prefill_attention`'s sparse path (kernels/prefill_attention.py) is token-major: a program holds one token (or a
few) and gathers its top-k blocks, so with selections that differ from token to token every (token, KV group,
block) costs a 64 KB K/V read from L2, and that traffic bounds it (docs/benchmarks.md, "Prefill"). Here the loop
is turned around (P7 tried it with W = 4-8 pairs a program and a torch work list; both were too slow):

1. Pairs. Every (row, KV head, slot) of `block_ids` [N, Hkv, K] with a block names one segment key
   (kv head, request, block). The work list is built on the device in three launches, no host sync:
   `_count_kernel` counts the pairs per key with atomics (the atomic's old value is the pair's slot in its
   segment) into a buffer kept zeroed between calls, `_offsets_kernel` (one program) scans the counts into
   segment starts and the running count of programs (ceil(count / W) a segment) and zeroes the counts again,
   `_scatter_kernel` puts every pair at its segment slot and maps each program to its segment (a binary search
   over the program counts). The order inside a segment is whatever the atomics gave: it changes no value, each
   partial being computed on its own and merged by (row, slot).
2. Split: a program takes up to W pairs of one segment, loads the block's K and V once (one page: a whole-page
   tile or two halves) and loops over sub-tiles of SUB pairs (SUB * G rows, G query heads of the KV group): each
   row's softmax over the block's visible keys, stored as a normalised partial output (q's dtype: a convex
   combination of V rows loses no more than the output's own rounding) and its log-sum-exp (fp32, base 2). The
   token-level causal mask only matters in a token's own block, so it runs only for sub-tiles where some row's
   position is below the block's last key (a runtime branch).
3. Merge: a program per (row, KV head) combines the row's K partials by their log-sum-exp.

Rows go in slices of at most `max_rows` so the partials (rows * Hkv * K * G * D in q's dtype) stay bounded.
Bytes per (token, group, block): K/V shared by up to W tokens (64 KB / W), the token's query rows (4 KB, from
L2), a partial written and read back (4 KB each). The torch reference is `paged_attention_ref`
(kernels/attention.py) with `block_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton import arrival_counters, next_pow2, runnable
from kernels.prefill_attention import _scores, _softmax_update

_LOG2E = 1.4426950408889634
_FAR = tl.constexpr(1 << 30)  # a position past every key: padding rows never ask for the causal mask

# Launch options: pairs per program (W, a runtime value), pairs per sub-tile (SUB; SUB * G rows per tl.dot),
# keys per tile (the page, or half of it), warps, stages, prompt rows per slice (bounds the partials: 4,096 rows
# x 4 KV heads x top-16 x 16 heads x 128 x bf16 = 512 MiB). H200 sweep (docs/benchmarks.md P9: W 32/64/128, SUB
# 4/8, 64/128-key tiles, 4/8 warps, 1/2 stages, the mask branch, 2,048-row slices): the best total was within
# 3% of these defaults at 2k x 8k and 2k x 32k, so they stay. P10: K/V loaded again per sub-tile (from L2)
# instead of held across them was 30-45% slower.
SPLIT_LAUNCH = {"pairs": 64, "sub": 4, "block_n": 128, "num_warps": 4, "num_stages": 2, "max_rows": 4096,
                "mask_branch": True}

# When the prompt rows take this kernel rather than the token-major one (host ints only, see `use_block_major`):
# between `min_rows_per_request` and `max_rows_per_request` rows per request on average (enough tokens to share
# a block; past ~4k rows the partials' traffic outgrows what sharing saves: H200, P9, 8k x 8k took 2.98-3.27 ms
# block-major against 2.86 token-major, while 2k rows gained 5-13%), a page table wider than
# `min_blocks_per_topk` x top-k blocks (with fewer blocks the token-major kernel's token tiles already share most
# blocks); `max_keys` bounds the segment keys (Hkv x requests x width) the one-program scan walks; fp32 (parity
# runs) stays token-major unless `fp32` says otherwise (fp32 dots spill here, see `split_options`).
BLOCK_MAJOR_RULE = {"min_rows_per_request": 512, "max_rows_per_request": 4096, "min_blocks_per_topk": 2.0,
                    "max_keys": 1 << 16, "fp32": False}


def use_block_major(num_rows: int, num_requests: int, width: int, topk: int, num_kv_heads: int,
                    fp32: bool = False) -> bool:
    """Whether `num_rows` prompt rows of `num_requests` requests, page tables `width` blocks wide, go block-major
    (host ints only: no sync)."""
    rule = BLOCK_MAJOR_RULE
    requests = max(num_requests, 1)
    return (rule["min_rows_per_request"] * requests <= num_rows <= rule["max_rows_per_request"] * requests
            and width > rule["min_blocks_per_topk"] * topk
            and num_kv_heads * num_requests * width <= rule["max_keys"]
            and (rule["fp32"] or not fp32))


def workspace_bytes(num_rows: int, num_kv_heads: int, topk: int, group: int, head_dim: int, itemsize: int) -> int:
    """Device bytes one block-major call holds at once for `num_rows` prompt rows: the partials of a row slice
    (min(rows, max_rows) x Hkv x topk pairs, each G x D in q's dtype plus an fp32 lse per head) and the work
    list's per-pair ints (key, rank, perm: int32). What the engine's memory profile keeps free beside its own
    profile step, which takes the token-major path at its larger size (workers/memory.py)."""
    pairs = min(num_rows, int(SPLIT_LAUNCH["max_rows"])) * num_kv_heads * topk
    return pairs * group * (head_dim * itemsize + 4) + pairs * 3 * 4


# ---- the work list ----------------------------------------------------------------------------------------------

@triton.jit
def _upper_bound(arr_ptr, x, lo, hi, want, steps):
    # per lane: the first index in [lo, hi) whose ascending arr value is > x (hi if none), in `steps` halvings
    for _ in range(steps):
        live = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(arr_ptr + mid, mask=live & want, other=0) <= x
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & ~right, mid, hi)
    return lo


# host ints that change from step to step are not specialised on (== 1, divisible by 16): no compile mid-serving
@triton.jit(do_not_specialize=["num_pairs", "row0", "num_requests", "search_steps", "width"])
def _count_kernel(bid_ptr, qsl_ptr, cnt_ptr, key_ptr, rank_ptr, num_pairs, row0, num_requests, search_steps,
                  width, bid_st_n, bid_st_h, HKV: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    # pairs p = (row * HKV + h) * TOPK + k of the slice: key[p] = (h, request, block) or -1, rank[p] = its slot
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
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


@triton.jit(do_not_specialize=["num_keys"])
def _offsets_kernel(cnt_ptr, seg_ptr, pend_ptr, num_keys, pairs_per_prog, BLOCK: tl.constexpr):
    # one program: seg[k] = pairs of keys before k (exclusive scan, seg[num_keys] = all pairs), pend[k] =
    # programs of keys up to k (inclusive); the counts are zeroed for the next call
    seen = tl.zeros([1], tl.int32)
    progs = tl.zeros([1], tl.int32)
    for s in range(0, num_keys, BLOCK):
        k = s + tl.arange(0, BLOCK)
        live = k < num_keys
        c = tl.load(cnt_ptr + k, mask=live, other=0)
        tl.store(cnt_ptr + k, tl.zeros([BLOCK], tl.int32), mask=live)
        pc = (c + pairs_per_prog - 1) // pairs_per_prog
        c_incl = tl.cumsum(c, 0)
        p_incl = tl.cumsum(pc, 0)
        tl.store(seg_ptr + k, seen + c_incl - c, mask=live)
        tl.store(pend_ptr + k, progs + p_incl, mask=live)
        seen += tl.sum(c, 0)
        progs += tl.sum(pc, 0)
    tl.store(seg_ptr + num_keys + tl.arange(0, 1), seen)


@triton.jit(do_not_specialize=["num_pairs", "num_items", "num_keys", "search_steps"])
def _scatter_kernel(key_ptr, rank_ptr, seg_ptr, pend_ptr, perm_ptr, item_ptr, num_pairs, num_items, num_keys,
                    search_steps, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # pair i to its segment slot
    inb = i < num_pairs
    key = tl.load(key_ptr + i, mask=inb, other=-1)
    ok = inb & (key >= 0)
    dst = tl.load(seg_ptr + key, mask=ok, other=0) + tl.load(rank_ptr + i, mask=ok, other=0)
    tl.store(perm_ptr + dst, i, mask=ok)
    # program i to its segment: the first key whose running program count passes i (-1 past the last program)
    want = i < num_items
    lo = _upper_bound(pend_ptr, i, tl.zeros([BLOCK], tl.int32), tl.zeros([BLOCK], tl.int32) + num_keys, want,
                      search_steps)
    tl.store(item_ptr + i, tl.where(lo < num_keys, lo, -1), mask=want)


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


def build_work_list(block_ids: torch.Tensor, query_start_loc: torch.Tensor, row0: int, num_requests: int,
                    width: int, pairs_per_prog: int) -> WorkList:
    """block_ids [n, Hkv, K] int32 (rows row0 .. row0 + n - 1 of the prompt rows; -1: no block); query_start_loc
    [>= num_requests + 1] int32 over the prompt rows; width: the page tables' width in blocks (every selected id is
    below it). Three launches, no host sync; the grid bound is ceil(pairs / W) + min(pairs, keys)."""
    n, hkv, topk = block_ids.shape
    dev = block_ids.device
    num_pairs = n * hkv * topk
    num_keys = hkv * num_requests * width
    i32 = torch.int32
    counts = arrival_counters("prefill_split", num_keys, dev, 4096)  # zeroed, and left zeroed by the scan
    if counts is None:  # (growing it under CUDA-graph capture: never for prompt rows, which run eager)
        counts = torch.zeros(num_keys, dtype=i32, device=dev)
    key = torch.empty(num_pairs, dtype=i32, device=dev)
    rank = torch.empty(num_pairs, dtype=i32, device=dev)
    block = 1024
    runnable(_count_kernel, dev)[(triton.cdiv(num_pairs, block),)](
        block_ids, query_start_loc, counts, key, rank, num_pairs, row0, num_requests,
        max(1, num_requests.bit_length()), width, block_ids.stride(0), block_ids.stride(1),
        HKV=hkv, TOPK=topk, BLOCK=block, num_warps=4)
    seg_start = torch.empty(num_keys + 1, dtype=i32, device=dev)
    prog_end = torch.empty(num_keys, dtype=i32, device=dev)
    runnable(_offsets_kernel, dev)[(1,)](counts, seg_start, prog_end, num_keys, pairs_per_prog, BLOCK=2048,
                                         num_warps=8)
    num_items = triton.cdiv(num_pairs, pairs_per_prog) + min(num_pairs, num_keys)
    perm = torch.empty(num_pairs, dtype=i32, device=dev)
    items = torch.empty(num_items, dtype=i32, device=dev)
    runnable(_scatter_kernel, dev)[(triton.cdiv(max(num_pairs, num_items), block),)](
        key, rank, seg_start, prog_end, perm, items, num_pairs, num_items, num_keys, num_keys.bit_length() + 1,
        BLOCK=block, num_warps=4)
    return WorkList(seg_start, prog_end, perm, items, num_items, pairs_per_prog, num_requests, width)


# ---- split and merge --------------------------------------------------------------------------------------------

@triton.jit
def _block_step(q, k, v, keys, pos, need_mask, m_i, l_i, acc, qk_scale_log2, DOT_FP32: tl.constexpr,
                MASK_BRANCH: tl.constexpr):
    # one K/V tile [BN, D] held by the program against the sub-tile's rows [M] (prefill_attention's softmax
    # update). keys [BN] absolute key positions, pos [M] row positions; need_mask: some row sees only part of it.
    qk = _scores(q, k, qk_scale_log2, DOT_FP32)
    if MASK_BRANCH:
        if need_mask:
            qk = tl.where(keys[None, :] <= pos[:, None], qk, float("-inf"))
    else:
        qk = tl.where(keys[None, :] <= pos[:, None], qk, float("-inf"))
    return _softmax_update(qk, v, m_i, l_i, acc, DOT_FP32)


@triton.jit(do_not_specialize=["num_requests", "width"])
def _split_kernel(q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, item_ptr, seg_ptr, pend_ptr, perm_ptr,
                  po_ptr, pl_ptr, q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r,
                  pairs_per_prog, num_requests, width, qk_scale_log2,
                  G: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAIRS_PER_ROW: tl.constexpr, DOT_FP32: tl.constexpr, MASK_BRANCH: tl.constexpr):
    pid = tl.program_id(0)
    key = tl.load(item_ptr + pid)
    if key < 0:  # past the end of the work list
        return
    kvh = key // (num_requests * width)
    req = (key // width) % num_requests
    blk = key % width
    seg0 = tl.load(seg_ptr + key)
    count = tl.load(seg_ptr + key + 1) - seg0
    # this program's place among its segment's programs -> its first slot and its pairs
    j = pid - (tl.load(pend_ptr + key) - (count + pairs_per_prog - 1) // pairs_per_prog)
    first = seg0 + j * pairs_per_prog
    n_here = tl.minimum(pairs_per_prog, count - j * pairs_per_prog)
    page = tl.load(pt_ptr + req.to(tl.int64) * pt_st_r + blk).to(tl.int64)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    kv_row = page * kc_st_p + kvh * kc_st_h
    k0 = tl.load(kc_ptr + kv_row + n[:, None] * kc_st_o + d[None, :])
    v0 = tl.load(vc_ptr + page * vc_st_p + kvh * vc_st_h + n[:, None] * vc_st_o + d[None, :])
    TWO: tl.constexpr = PS // BLOCK_N == 2
    if TWO:  # the page's second half, held too
        k1 = tl.load(kc_ptr + kv_row + (BLOCK_N + n)[:, None] * kc_st_o + d[None, :])
        v1 = tl.load(vc_ptr + page * vc_st_p + kvh * vc_st_h + (BLOCK_N + n)[:, None] * vc_st_o + d[None, :])
    key0 = blk * PS
    BM: tl.constexpr = SUB * G
    mm = tl.arange(0, BM)
    slot = mm // G  # row m: pair `slot` of the sub-tile, query head m % G of the KV group
    heads = kvh * G + mm % G
    for s in range(0, n_here, SUB):
        ok = s + slot < n_here
        pair = tl.load(perm_ptr + first + s + slot, mask=ok, other=0)
        row = (pair // PAIRS_PER_ROW).to(tl.int64)
        pos = tl.load(pos_ptr + row, mask=ok, other=_FAR).to(tl.int32)
        q = tl.load(q_ptr + row[:, None] * q_st_n + heads[:, None] * q_st_h + d[None, :], mask=ok[:, None],
                    other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        need_mask = tl.min(pos, axis=0) < key0 + PS - 1  # some row's own block (or earlier): mask keys > pos
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        m_i, l_i, acc = _block_step(q, k0, v0, key0 + n, pos, need_mask, m_i, l_i, acc, qk_scale_log2, DOT_FP32,
                                    MASK_BRANCH)
        if TWO:
            m_i, l_i, acc = _block_step(q, k1, v1, key0 + BLOCK_N + n, pos, need_mask, m_i, l_i, acc,
                                        qk_scale_log2, DOT_FP32, MASK_BRANCH)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        prow = pair.to(tl.int64) * G + mm % G  # the partial of (pair, head)
        tl.store(po_ptr + prow[:, None] * D + d[None, :], out.to(po_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(pl_ptr + prow, lse, mask=ok)


@triton.jit
def _merge_kernel(bid_ptr, po_ptr, pl_ptr, o_ptr, bid_st_n, bid_st_h, o_st_n, o_st_h,
                  G: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, TOPK: tl.constexpr,
                  BLOCK_TOPK: tl.constexpr):
    # program (row, KV head): out = sum_k 2^(lse_k - m) part_k / sum_k 2^(lse_k - m) over the row's selected
    # slots (a -1 slot has no partial; a partial with lse -inf saw no key and weighs nothing). The row's
    # partials are one contiguous [TOPK, G, D] run.
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    kk = tl.arange(0, BLOCK_TOPK)
    sel = tl.load(bid_ptr + row * bid_st_n + kvh * bid_st_h + kk, mask=kk < TOPK, other=-1)
    base = (row * HKV + kvh) * TOPK
    pl_row = pl_ptr + base * G
    po_row = po_ptr + base * (G * D)
    lse_all = tl.load(pl_row + kk[:, None] * G + g[None, :], mask=(sel >= 0)[:, None],
                      other=float("-inf"))  # [BLOCK_TOPK, G]
    m = tl.max(lse_all, axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)
    den = tl.sum(tl.exp2(lse_all - m[None, :]), axis=0)
    acc = tl.zeros([G, D], tl.float32)
    tile = g[:, None] * D + d[None, :]
    for k in tl.static_range(TOPK):  # unrolled: every partial's load in flight at once
        valid = tl.load(bid_ptr + row * bid_st_n + kvh * bid_st_h + k) >= 0
        lse_k = tl.load(pl_row + k * G + g, mask=valid, other=float("-inf"))
        # masked by the selection only, not by the lse, so no load waits for another: a selected block's partial
        # is always written (zeros where it saw no key, weighted 2^-inf = 0). H200 (P10): the merge 303 -> 184 us
        # at 2k x 8k. Tried and slower: one [TOPK, G, D] tile load (2.5x), 2 or 8 warps.
        part = tl.load(po_row + k * (G * D) + tile, mask=valid, other=0.0)
        acc += part.to(tl.float32) * tl.exp2(lse_k - m)[:, None]
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(o_ptr + row * o_st_n + (kvh * G + g)[:, None] * o_st_h + d[None, :], out.to(o_ptr.dtype.element_ty))


def split_options(launch: dict | None, group: int, page_size: int, fp32: bool) -> dict:
    """SPLIT_LAUNCH with `launch` over it, fitted to the shapes: SUB * G >= 16 rows (tl.dot), a tile of the whole
    page or half of it."""
    opts = dict(SPLIT_LAUNCH)
    if fp32 and launch is None:
        # fp32 dots run on FMA units and spill at 64 rows (ptxas, sm_90): the fewest rows tl.dot takes, one stage
        opts["sub"], opts["num_stages"] = 1, 1
    opts.update(launch or {})
    opts["sub"] = max(int(opts["sub"]), -(-16 // group))
    opts["block_n"] = max(min(int(opts["block_n"]), page_size), page_size // 2)
    opts["pairs"] = max(int(opts["pairs"]), 1)
    return opts


def split_merge(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                positions: torch.Tensor, block_ids: torch.Tensor, scale: float, work: WorkList, out: torch.Tensor,
                part_o: torch.Tensor, part_lse: torch.Tensor, opts: dict) -> torch.Tensor:
    """The split and merge launches of one slice of rows (q, positions, block_ids, out: the slice's rows) over
    its work list; part_o [>= pairs * G, D] and part_lse [>= pairs * G] are the workspace."""
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    group, topk = hq // hkv, block_ids.shape[-1]
    sub = opts["sub"]
    sub = sub if sub & (sub - 1) == 0 else next_pow2(sub)
    runnable(_split_kernel, q.device)[(work.num_items,)](
        q, k_cache, v_cache, page_tables, positions, work.items, work.seg_start, work.prog_end,
        work.perm, part_o, part_lse, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_tables.stride(0),
        work.pairs_per_prog, work.num_requests, work.width, float(scale) * _LOG2E,
        G=group, SUB=sub, D=d, PS=ps, BLOCK_N=opts["block_n"], PAIRS_PER_ROW=hkv * topk,
        DOT_FP32=torch.float32 in (q.dtype, k_cache.dtype), MASK_BRANCH=bool(opts["mask_branch"]),
        num_warps=opts["num_warps"], num_stages=opts["num_stages"])
    runnable(_merge_kernel, q.device)[(n, hkv)](
        block_ids, part_o, part_lse, out, block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1),
        G=group, D=d, HKV=hkv, TOPK=topk, BLOCK_TOPK=max(2, next_pow2(topk)), num_warps=4)
    return out


def _check_inputs(q, k_cache, v_cache, page_tables, query_start_loc, block_ids, num_requests) -> None:
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_tables", page_tables),
                    ("block_ids", block_ids)):
        if x.stride(-1) != 1:
            raise ValueError(f"sparse split: {name} needs a unit stride on its last dim, got {x.stride()}")
    if d & (d - 1) or ps & (ps - 1) or d < 16 or ps < 16:
        raise ValueError(f"sparse split: head_dim {d} and page_size {ps} must be powers of two >= 16")
    group = hq // hkv
    if group & (group - 1) or hq % hkv:
        raise ValueError(f"sparse split: {hq} query heads over {hkv} KV heads: the group must be a power of two")
    if block_ids.dtype != torch.int32 or block_ids.shape[:2] != (n, hkv):
        raise ValueError(f"sparse split: block_ids must be int32 [{n}, {hkv}, topk], got {block_ids.dtype} "
                         f"{tuple(block_ids.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.numel() < num_requests + 1:
        raise ValueError("sparse split: query_start_loc must be int32 [>= num_requests + 1]")


def prefill_sparse_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                         query_start_loc: torch.Tensor, positions: torch.Tensor, scale: float,
                         block_ids: torch.Tensor, *, num_requests: int, max_len: int = 0,
                         out: torch.Tensor | None = None, launch: dict | None = None) -> torch.Tensor:
    """Block-major sparse prefill attention of the prompt rows -> [N, Hq, D] in q's dtype (module docstring).

    The inputs of `prefill_attention`'s sparse path: q [N, Hq, D]; k/v_cache [P, ps, Hkv, D]; page_tables
    [>= num_requests, width] int32; query_start_loc [>= num_requests + 1] int32 (device; rows of request r are
    qsl[r] .. qsl[r + 1], qsl[num_requests] = N); positions [N]; block_ids [N, Hkv, topk] int32, -1 where a row
    selected fewer blocks (any order); max_len is not needed here. `launch` overrides SPLIT_LAUNCH. No host syncs.
    Workspace: min(N, max_rows) * Hkv * topk partials of G x D in q's dtype (and an fp32 lse each)."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if n == 0 or num_requests == 0:
        return out
    _check_inputs(q, k_cache, v_cache, page_tables, query_start_loc, block_ids, num_requests)
    group, topk = hq // hkv, block_ids.shape[-1]
    opts = split_options(launch, group, k_cache.shape[1], torch.float32 in (q.dtype, k_cache.dtype))
    max_rows = max(1, int(opts["max_rows"]))
    rows = min(n, max_rows)
    part_o = torch.empty((rows * hkv * topk * group, d), dtype=q.dtype, device=q.device)
    part_lse = torch.empty((rows * hkv * topk * group,), dtype=torch.float32, device=q.device)
    for a in range(0, n, max_rows):
        b = min(n, a + max_rows)
        work = build_work_list(block_ids[a:b], query_start_loc, a, num_requests, page_tables.shape[1],
                               opts["pairs"])
        split_merge(q[a:b], k_cache, v_cache, page_tables, positions[a:b], block_ids[a:b], scale, work, out[a:b],
                    part_o, part_lse, opts)
    return out


__all__ = ["BLOCK_MAJOR_RULE", "SPLIT_LAUNCH", "WorkList", "build_work_list", "prefill_sparse_split", "split_merge",
           "split_options", "use_block_major", "workspace_bytes"]
