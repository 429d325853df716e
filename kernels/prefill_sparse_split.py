"""Block-major MSA sparse prefill attention: each selected K/V block is read once for the many tokens that chose it.

`prefill_attention`'s sparse path (kernels/prefill_attention.py) is token-major: a program holds one token (or a
few) and gathers its top-k blocks, so with selections that differ from token to token every (token, KV group,
block) costs a 64 KB K/V read from L2, and that traffic bounds it (docs/benchmarks.md, "Prefill"). Here the loop
is turned around (P7 tried it with W = 4-8 pairs a program and a torch work list; both were too slow):

1. Pairs. Every (row, KV head, slot) of `block_ids` [N, Hkv, K] with a block names one segment key
   (kv head, request, block). The work list groups the pairs by key on the device, no host sync
   (kernels/sparse_work_list.py).
2. Split: a program takes up to W pairs of one segment, loads the block's K and V once (one page: a whole-page
   tile or two halves) and loops over sub-tiles of SUB pairs (SUB * G rows, G query heads of the KV group): each
   row's softmax over the block's visible keys, stored as a normalised partial output (q's dtype: a convex
   combination of V rows loses no more than the output's own rounding) and its log-sum-exp (fp32, base 2). The
   token-level causal mask only matters in a token's own block, so it runs only for sub-tiles where some row's
   position is below the block's last key (a runtime branch). The loop issues the next sub-tile's query loads
   before its own dots.
3. Merge: a program per (row, KV head) combines the row's K partials by their log-sum-exp.

Launches per row slice: the work list (two: count with the scan folded into its last program, scatter), the
split, the merge. `fused` (the default) builds the work list in one persistent, cooperatively launched kernel
(grid-wide syncs between the phases): fewer launches are host time that PERF.md's single-call method counts
(docs/benchmarks.md P11). `fuse_split` also runs the split's programs inside it (handed out by a ticket); they ran
~10-13% slower there than launched (P16: 255 registers and spills inside it, 243 and none launched), so by default
the split is a launch of its own.

Rows go in slices of at most `max_rows` so the partials (rows * Hkv * K * G * D in q's dtype) stay bounded.
Bytes per (token, group, block): K/V shared by up to W tokens (64 KB / W), the token's query rows (4 KB, from
L2), a partial written and read back (4 KB each). The torch reference is `paged_attention_ref`
(kernels/attention.py) with `block_ids`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import CompiledLaunch, next_pow2, num_sms, runnable
from kernels.prefill_attention import _raw_scores, _scores, _softmax_update
from kernels.sparse_work_list import (CHUNK, WorkBuffers, WorkList, build_work_list, count_chunk, scan_counts,
                                      scatter_chunk, work_buffers)

_LOG2E = 1.4426950408889634
_FAR = tl.constexpr(1 << 30)  # a position past every key: padding rows never ask for the causal mask

# Launch options: pairs per program (W, a runtime value), pairs per sub-tile (SUB; SUB * G rows per tl.dot),
# keys per tile (the page, or half of it), warps, stages, prompt rows per slice (bounds the partials: 4,096 rows
# x 4 KV heads x top-16 x 16 heads x 128 x bf16 = 512 MiB). H200 sweep (docs/benchmarks.md P9: W 32/64/128, SUB
# 4/8, 64/128-key tiles, 4/8 warps, 1/2 stages, the mask branch, 2,048-row slices): the best total was within
# 3% of these defaults at 2k x 8k and 2k x 32k, so they stay. P10: K/V loaded again per sub-tile (from L2)
# instead of held across them was 30-45% slower. P11: the loop's loads run ahead (split -12%; no switch), the
# fused persistent kernel (`fused`: one launch for the work list and split, same device time, ~150 us less host
# time a call) and partial stores marked evict-first were each the faster in the same lease. `fused: False` is the
# fallback: the work list's two launches (kernels/sparse_work_list.py), then the split. `fuse_split` (off): the
# split's items run inside the persistent kernel too; P16 (H100, one run, 2k x 8k): that kernel took 487 us where
# the work list alone (~30) and the split launched after it (400) took ~430, the call's device time 682 against
# 630 us, so the persistent kernel builds the work list only and the split is a launch of its own (events of one
# call -3% to -6% at the three P16 cases).
SPLIT_LAUNCH = {"pairs": 64, "sub": 4, "block_n": 128, "num_warps": 4, "num_stages": 2, "max_rows": 4096,
                "mask_branch": True, "fused": True, "fuse_split": False, "evict_first": True}

# When the prompt rows take this kernel rather than the token-major one (host ints only, see `use_block_major`):
# between `min_rows_per_request` and `max_rows_per_request` rows per request on average (enough tokens to share
# a block; H200, P11: 8k x 8k 2.60 ms block-major against 2.92 token-major, 8k x 32k 2.94 against 4.37, 2k rows
# 15-25% faster; 16k-row chunks not measured), a page table wider than
# `min_blocks_per_topk` x top-k blocks (with fewer blocks the token-major kernel's token tiles already share most
# blocks); `max_keys` bounds the segment keys (Hkv x requests x width) the one-program scan walks; fp32 (parity
# runs) stays token-major unless `fp32` says otherwise (fp32 dots spill here, see `split_options`).
BLOCK_MAJOR_RULE = {"min_rows_per_request": 512, "max_rows_per_request": 8192, "min_blocks_per_topk": 2.0,
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


# Buffers kept from call to call per device: the same shapes come back layer after layer of a step (and call after
# call of a benchmark), and each allocation is host time before the first launch, which PERF.md's single-call
# method counts. The work lists' (small: a few shapes kept) and the partials (per dtype, the largest slice seen;
# the engine's memory profile reserves them, `workspace_bytes`). One stream at a time per device, as the arrival
# counters; the fused path only (the unfused path's work list is returned to its caller).
_WORK: dict[tuple, WorkBuffers] = {}
_PARTIALS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_WORK_SHAPES_KEPT = 8


def _kept_work_buffers(num_pairs: int, num_keys: int, pairs_per_prog: int, device: torch.device) -> WorkBuffers:
    key = (device, num_pairs, num_keys, pairs_per_prog)
    buf = _WORK.get(key)
    if buf is None:
        if len(_WORK) >= _WORK_SHAPES_KEPT:
            _WORK.clear()
        buf = _WORK[key] = work_buffers(num_pairs, num_keys, pairs_per_prog, device)
    return buf


def _kept_partials(rows: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_o [>= rows, head_dim] in dtype, part_lse [>= rows] fp32) for `rows` (pair, head) partials."""
    key = (device, dtype, head_dim)
    got = _PARTIALS.get(key)
    if got is None or got[1].numel() < rows:
        _PARTIALS.pop(key, None)  # the smaller pair goes back to the allocator before the larger one is taken
        got = _PARTIALS[key] = (torch.empty((rows, head_dim), dtype=dtype, device=device),
                                torch.empty((rows,), dtype=torch.float32, device=device))
    return got


def release_workspace() -> None:
    """Drop the kept buffers (after a failed step or the memory profile: what torch's cache gives back then)."""
    _WORK.clear()
    _PARTIALS.clear()


def workspace_bytes(num_rows: int, num_kv_heads: int, topk: int, group: int, head_dim: int, itemsize: int) -> int:
    """Device bytes one block-major call holds at once for `num_rows` prompt rows: the partials of a row slice
    (min(rows, max_rows) x Hkv x topk pairs, each G x D in q's dtype plus an fp32 lse per head) and the work
    list's per-pair ints (key, rank, perm: int32). What the engine's memory profile keeps free beside its own
    profile step, which takes the token-major path at its larger size (workers/memory.py)."""
    pairs = min(num_rows, int(SPLIT_LAUNCH["max_rows"])) * num_kv_heads * topk
    return pairs * group * (head_dim * itemsize + 4) + pairs * 3 * 4


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
def _split_kernel(item_ptr, q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, seg_ptr, pend_ptr, perm_ptr, po_ptr, pl_ptr,
                  q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r, pairs_per_prog,
                  num_requests, width, qk_scale_log2, G: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr,
                  PS: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS_PER_ROW: tl.constexpr, DOT_FP32: tl.constexpr,
                  MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    key = tl.load(item_ptr + pid)
    if key >= 0:  # else past the end of the work list
        _split_item(pid, key, q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, seg_ptr, pend_ptr, perm_ptr, po_ptr, pl_ptr,
                    q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r, pairs_per_prog,
                    num_requests, width, qk_scale_log2, G, SUB, D, PS, BLOCK_N, PAIRS_PER_ROW, DOT_FP32,
                    MASK_BRANCH, EVICT_FIRST)


@triton.jit
def _split_item(pid, key, q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, seg_ptr, pend_ptr, perm_ptr, po_ptr, pl_ptr,
                q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r, pairs_per_prog,
                num_requests, width, qk_scale_log2, G: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr,
                PS: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS_PER_ROW: tl.constexpr, DOT_FP32: tl.constexpr,
                MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr):
    # program `pid` of the work list, of segment `key`: its up to W pairs against the segment's block. `.cg`
    # reads of the work list: in the fused kernel other programs of the same launch wrote it.
    kvh = key // (num_requests * width)
    req = (key // width) % num_requests
    blk = key % width
    seg0 = tl.load(seg_ptr + key, cache_modifier=".cg")
    count = tl.load(seg_ptr + key + 1, cache_modifier=".cg") - seg0
    # this program's place among its segment's programs -> its first slot and its pairs
    j = pid - (tl.load(pend_ptr + key, cache_modifier=".cg") - (count + pairs_per_prog - 1) // pairs_per_prog)
    first = seg0 + j * pairs_per_prog
    n_here = tl.minimum(pairs_per_prog, count - j * pairs_per_prog)
    page = tl.load(pt_ptr + req.to(tl.int64) * pt_st_r + blk).to(tl.int64)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    kv_row = page * kc_st_p + kvh * kc_st_h
    k0 = tl.load(kc_ptr + kv_row + n[:, None] * kc_st_o + d[None, :])
    v0 = tl.load(vc_ptr + page * vc_st_p + kvh * vc_st_h + n[:, None] * vc_st_o + d[None, :])
    if PS == 2 * BLOCK_N:  # the page's second half, held too
        k1 = tl.load(kc_ptr + kv_row + (BLOCK_N + n)[:, None] * kc_st_o + d[None, :])
        v1 = tl.load(vc_ptr + page * vc_st_p + kvh * vc_st_h + (BLOCK_N + n)[:, None] * vc_st_o + d[None, :])
    else:  # one tile holds the page (k1 / v1 unused)
        k1, v1 = k0, v0
    key0 = blk * PS
    BM: tl.constexpr = SUB * G
    mm = tl.arange(0, BM)
    slot = mm // G  # row m: pair `slot` of the sub-tile, query head m % G of the KV group
    heads = kvh * G + mm % G
    # loads run ahead of the dots: the next sub-tile's query rows and the one after's pair ids are issued
    # before this sub-tile's dots, so their L2 latency (pair id -> row -> q, two dependent loads) hides
    # behind them instead of opening each iteration (Triton's own pipelining issued the pair load of sub-tile
    # s + 1 at the end of iteration s and waited on it there).
    ok, pair = _sub_pairs(perm_ptr, first, 0, n_here, slot)
    pos, q = _sub_queries(q_ptr, pos_ptr, pair, ok, heads, d, q_st_n, q_st_h, PAIRS_PER_ROW, DOT_FP32)
    ok_n, pair_n = _sub_pairs(perm_ptr, first, SUB, n_here, slot)
    for s in range(0, n_here, SUB):
        ok_nn, pair_nn = _sub_pairs(perm_ptr, first, s + 2 * SUB, n_here, slot)
        pos_n, q_n = _sub_queries(q_ptr, pos_ptr, pair_n, ok_n, heads, d, q_st_n, q_st_h, PAIRS_PER_ROW,
                                  DOT_FP32)
        out, lse = _sub_tile(q, pos, k0, v0, k1, v1, key0, n, qk_scale_log2, BM, D, PS, BLOCK_N, DOT_FP32,
                             MASK_BRANCH)
        _store_partial(po_ptr, pl_ptr, pair, ok, out, lse, mm, d, G, D, EVICT_FIRST)
        ok, pair, pos, q = ok_n, pair_n, pos_n, q_n
        ok_n, pair_n = ok_nn, pair_nn


@triton.jit
def _sub_pairs(perm_ptr, first, s, n_here, slot):
    # the pair ids of sub-tile s (slot [BM]: each row's pair within the sub-tile) and which rows are real
    ok = s + slot < n_here
    return ok, tl.load(perm_ptr + first + s + slot, mask=ok, other=0, cache_modifier=".cg")


@triton.jit
def _sub_queries(q_ptr, pos_ptr, pair, ok, heads, d, q_st_n, q_st_h, PAIRS_PER_ROW: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    # the sub-tile's query rows [BM, D] (row = pair's prompt row, head of the KV group) and their positions [BM]
    row = (pair // PAIRS_PER_ROW).to(tl.int64)
    pos = tl.load(pos_ptr + row, mask=ok, other=_FAR).to(tl.int32)
    q = tl.load(q_ptr + row[:, None] * q_st_n + heads[:, None] * q_st_h + d[None, :], mask=ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return pos, q


@triton.jit
def _sub_tile(q, pos, k0, v0, k1, v1, key0, n, qk_scale_log2, BM: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, MASK_BRANCH: tl.constexpr):
    # the sub-tile's rows against the held block -> (normalised output [BM, D] fp32, lse [BM] base 2, -inf where
    # a row saw no key)
    need_mask = tl.min(pos, axis=0) < key0 + PS - 1  # some row's own block (or earlier): mask keys > pos
    if PS == BLOCK_N:
        # one tile: a plain softmax, no running max to rescale by. The logits stay unscaled up to the exp2, whose
        # argument takes the scale in one FMA (the scale positive: the max commutes with it); a multiply of its
        # own was 64 more instructions a thread a sub-tile (offline SASS, docs/benchmarks.md P16)
        qk = _raw_scores(q, k0, DOT_FP32)
        if MASK_BRANCH:
            if need_mask:
                qk = tl.where((key0 + n)[None, :] <= pos[:, None], qk, float("-inf"))
        else:
            qk = tl.where((key0 + n)[None, :] <= pos[:, None], qk, float("-inf"))
        m_raw = tl.max(qk, axis=1)
        m_i = tl.where(m_raw > float("-inf"), m_raw * qk_scale_log2, 0.0)  # base-2, scaled; 0 where no key
        p = tl.exp2(qk * qk_scale_log2 - m_i[:, None])
        l_i = tl.sum(p, axis=1)
        if DOT_FP32:
            acc = tl.dot(p, v0.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(p.to(v0.dtype), v0)
    else:
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        m_i, l_i, acc = _block_step(q, k0, v0, key0 + n, pos, need_mask, m_i, l_i, acc, qk_scale_log2, DOT_FP32,
                                    MASK_BRANCH)
        m_i, l_i, acc = _block_step(q, k1, v1, key0 + BLOCK_N + n, pos, need_mask, m_i, l_i, acc, qk_scale_log2,
                                    DOT_FP32, MASK_BRANCH)
    has = l_i > 0
    # one reciprocal a row, then multiplies: `acc / l[:, None]` compiled to a range-checked divide per element
    # (FMUL, FSEL, FMUL: 192 instructions a thread a sub-tile against 64; offline SASS, docs/benchmarks.md P16)
    inv = 1.0 / tl.where(has, l_i, 1.0)
    out = acc * inv[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _store_partial(po_ptr, pl_ptr, pair, ok, out, lse, mm, d, G: tl.constexpr, D: tl.constexpr,
                   EVICT_FIRST: tl.constexpr):
    prow = pair.to(tl.int64) * G + mm % G  # the partial of (pair, head)
    if EVICT_FIRST:
        # the partials (rows x 4 KB x Hkv x top-k) stream through L2 once; marked first out, they leave the
        # query rows (gathered top-k times each) and the K/V blocks there
        tl.store(po_ptr + prow[:, None] * D + d[None, :], out.to(po_ptr.dtype.element_ty), mask=ok[:, None],
                 eviction_policy="evict_first")
    else:
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
    m_col = m[:, None]  # [G, 1]: converted to the partials' layout once, not once a partial
    for k in tl.static_range(TOPK):  # unrolled: every partial's load in flight at once
        valid = tl.load(bid_ptr + row * bid_st_n + kvh * bid_st_h + k) >= 0
        # [G, 1], in the partials' own layout: a [G] load broadcast to [G, D] went through shared memory with two
        # barriers a partial, each waiting on that partial's lse load (offline SASS: 39 barriers a program, 9 now)
        lse_k = tl.load(pl_row + k * G + g[:, None], mask=valid, other=float("-inf"))
        # masked by the selection only, not by the lse, so no load waits for another: a selected block's partial
        # is always written (zeros where it saw no key, weighted 2^-inf = 0). H200 (P10): the merge 303 -> 184 us
        # at 2k x 8k. Tried and slower: one [TOPK, G, D] tile load (2.5x), 2 or 8 warps.
        part = tl.load(po_row + k * (G * D) + tile, mask=valid, other=0.0)
        acc += part.to(tl.float32) * tl.exp2(lse_k - m_col)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(o_ptr + row * o_st_n + (kvh * G + g)[:, None] * o_st_h + d[None, :], out.to(o_ptr.dtype.element_ty))


# ---- the fused persistent kernel: work list and split in one launch ---------------------------------------------

@triton.jit
def _grid_sync(ctr_ptr, nprog):
    # every program of the grid (launched cooperatively: all resident at once) arrives; none goes on before all
    # have. The CTA barrier + release add publish this program's writes, the acquire reads see every program's.
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="acq_rel")
    seen = tl.atomic_add(ctr_ptr, 0, sem="acquire")
    while seen < nprog:
        seen = tl.atomic_add(ctr_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_pairs", "row0", "num_requests", "search_steps", "width", "num_keys",
                               "num_items", "key_steps"])
def _fused_kernel(bid_ptr, qsl_ptr, cnt_ptr, key_ptr, rank_ptr, seg_ptr, pend_ptr, perm_ptr, item_ptr,
                  q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, po_ptr, pl_ptr,
                  num_pairs, row0, num_requests, search_steps, width, num_keys, num_items, key_steps,
                  bid_st_n, bid_st_h, q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r,
                  pairs_per_prog, qk_scale_log2, HKV: tl.constexpr, TOPK: tl.constexpr, CHUNK: tl.constexpr,
                  G: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_FP32: tl.constexpr, MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr,
                  SPLIT: tl.constexpr):
    # The work list's three phases (kernels/sparse_work_list.py) and (SPLIT) the split as one persistent launch:
    # the launches it saves are host time that PERF.md's single-call method sees (docs/benchmarks.md P11). Grid-
    # wide syncs separate the phases; cnt[num_keys + 1 ..] hold their counters, the split's ticket and the exit
    # count, all zero at rest. Without SPLIT the work list alone (the split then a launch of its own).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    sync = cnt_ptr + num_keys
    for c in range(pid, tl.cdiv(num_pairs, CHUNK), nprog):
        count_chunk(c, bid_ptr, qsl_ptr, cnt_ptr, key_ptr, rank_ptr, num_pairs, row0, num_requests, search_steps,
                    width, bid_st_n, bid_st_h, HKV, TOPK, CHUNK)
    _grid_sync(sync + 1, nprog)
    if pid == 0:
        scan_counts(cnt_ptr, seg_ptr, pend_ptr, num_keys, pairs_per_prog, CHUNK)
    _grid_sync(sync + 2, nprog)
    for c in range(pid, tl.cdiv(tl.maximum(num_pairs, num_items), CHUNK), nprog):
        scatter_chunk(c, key_ptr, rank_ptr, seg_ptr, pend_ptr, perm_ptr, item_ptr, num_pairs, num_items, num_keys,
                      key_steps, CHUNK)
    if SPLIT:
        _grid_sync(sync + 3, nprog)
        # the split's programs as work items handed out by a ticket (items differ in size: dynamic balance)
        it = tl.atomic_add(sync + 4, 1)
        while it < num_items:
            key = tl.load(item_ptr + it, cache_modifier=".cg")
            if key >= 0:
                _split_item(it, key, q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, seg_ptr, pend_ptr, perm_ptr, po_ptr,
                            pl_ptr, q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r,
                            pairs_per_prog, num_requests, width, qk_scale_log2, G, SUB, D, PS, BLOCK_N, HKV * TOPK,
                            DOT_FP32, MASK_BRANCH, EVICT_FIRST)
                it = tl.atomic_add(sync + 4, 1)
            else:  # the items past the work list's end are all -1
                it = num_items
    # the last program out resets the counters: every program has passed every sync by then
    tl.debug_barrier()
    if tl.atomic_add(sync + 5, 1, sem="acq_rel") == nprog - 1:
        for i in tl.static_range(1, 6):
            tl.atomic_xchg(sync + i, 0)


# launched straight through its compiled launcher after the first call of each variant (kernels/_triton.py; host
# time of `fused_split`, H200 probe, two leases: 106 us in P12, 70 us with it in P14)
_FUSED = CompiledLaunch(_fused_kernel)
_SPLIT = CompiledLaunch(_split_kernel)

# programs of the fused kernel resident per SM, by (device, compiled variant): from its registers and shared
# memory once it has run (the first launch assumes one per SM, always resident). A cooperative launch larger than
# what fits is refused by CUDA with an error, never left to hang.
_RESIDENT: dict[tuple, int] = {}


def _resident_per_sm(kernel, num_warps: int, device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    regs_warp = -(-max(int(kernel.n_regs), 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = regs_sm // (regs_warp * num_warps)
    by_smem = smem_sm // (int(kernel.metadata.shared) + 1024)  # 1 KB per block reserved by the driver
    return max(1, min(by_regs, by_smem, threads_sm // (32 * num_warps), 32))


def fused_split(q, k_cache, v_cache, page_tables, query_start_loc, positions, block_ids, row0: int,
                num_requests: int, scale: float, part_o, part_lse, opts: dict) -> None:
    """The fused kernel over one slice of rows (q, positions, block_ids: the slice's rows): partials and their lse
    into part_o / part_lse, as `build_work_list` + the split launch would. One launch, a grid of what fits on the
    device at once (one program on CPU: the interpreter runs programs one after another); without `fuse_split` the
    persistent kernel builds the work list only and the split follows as a launch of its own."""
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    group, topk = hq // hkv, block_ids.shape[-1]
    width = page_tables.shape[1]
    dev = q.device
    pairs = opts["pairs"]
    buf = _kept_work_buffers(n * hkv * topk, hkv * num_requests * width, pairs, dev)
    consts = dict(HKV=hkv, TOPK=topk, CHUNK=CHUNK, G=group, SUB=_pow2_sub(opts), D=d, PS=ps,
                  BLOCK_N=opts["block_n"], DOT_FP32=torch.float32 in (q.dtype, k_cache.dtype),
                  MASK_BRANCH=bool(opts["mask_branch"]), EVICT_FIRST=bool(opts["evict_first"]),
                  SPLIT=bool(opts["fuse_split"]))
    key = (str(dev), q.dtype, k_cache.dtype, opts["num_warps"], opts["num_stages"], *consts.values())
    bs, qs, ks, vs = block_ids.stride(), q.stride(), k_cache.stride(), v_cache.stride()  # one call each: host time
    args = (block_ids, query_start_loc, buf.counts, buf.key, buf.rank, buf.seg_start, buf.prog_end, buf.perm,
            buf.items, q, k_cache, v_cache, page_tables, positions, part_o, part_lse, buf.num_pairs, row0, num_requests,
            max(1, num_requests.bit_length()), width, buf.num_keys, buf.num_items, buf.num_keys.bit_length() + 1,
            bs[0], bs[1], qs[0], qs[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], page_tables.stride(0), pairs,
            float(scale) * _LOG2E)
    launch = dict(num_warps=opts["num_warps"], num_stages=opts["num_stages"])
    if dev.type != "cuda":
        _FUSED((1,), args, consts, **launch)
    else:
        _fused_launch(args, consts, launch, key, buf)
    if not consts["SPLIT"]:
        # after the work list's launch, not prepared before it: the GPU runs the work list (30-80 us) while the
        # host prepares the split; prepared first (bab9c98), that host work only delayed the first launch
        # (docs/benchmarks.md P17)
        _launch_split(buf.items, buf.num_items, q, k_cache, v_cache, page_tables, positions, buf.seg_start,
                      buf.prog_end, buf.perm, part_o, part_lse, pairs, num_requests, width, scale, hkv * topk, opts,
                      strides=(qs, ks, vs))


def _fused_launch(args: tuple, consts: dict, launch: dict, key: tuple, buf: WorkBuffers) -> None:
    # the cooperative grid: what fits on the device at once (learnt after the first launch of the variant); the
    # work list alone needs no more programs than it has chunks
    dev = args[0].device
    sms = num_sms(dev)
    grid = max(1, min(sms * _RESIDENT.get(key, 1), buf.num_items))
    if not consts["SPLIT"]:
        grid = min(grid, triton.cdiv(max(buf.num_pairs, buf.num_items), CHUNK))
    try:
        kernel = _FUSED((grid,), args, consts, **launch, launch_cooperative_grid=True)
    except RuntimeError:
        if grid <= sms:
            raise
        # CUDA refused the grid as larger than what fits at once (a launch that never ran: the counters are
        # untouched); a program per SM always fits
        _RESIDENT[key] = 1
        kernel = _FUSED((min(sms, buf.num_items),), args, consts, **launch, launch_cooperative_grid=True)
    if key not in _RESIDENT and kernel is not None:  # None: a direct launch, after the JIT's first
        _RESIDENT[key] = _resident_per_sm(kernel, launch["num_warps"], dev)


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


def _pow2_sub(opts: dict) -> int:
    sub = int(opts["sub"])
    return sub if sub & (sub - 1) == 0 else next_pow2(sub)


def split_merge(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                positions: torch.Tensor, block_ids: torch.Tensor, scale: float, work: WorkList, out: torch.Tensor,
                part_o: torch.Tensor, part_lse: torch.Tensor, opts: dict) -> torch.Tensor:
    """The split and merge launches of one slice of rows (q, positions, block_ids, out: the slice's rows) over
    its work list; part_o [>= pairs * G, D] and part_lse [>= pairs * G] are the workspace."""
    _launch_split(work.items, work.num_items, q, k_cache, v_cache, page_tables, positions, work.seg_start,
                  work.prog_end, work.perm, part_o, part_lse, work.pairs_per_prog, work.num_requests, work.width,
                  scale, k_cache.shape[2] * block_ids.shape[-1], opts)
    return merge(block_ids, part_o, part_lse, out)


def _launch_split(items, num_items: int, q, k_cache, v_cache, page_tables, positions, seg_start, prog_end, perm,
                  part_o, part_lse, pairs_per_prog: int, num_requests: int, width: int, scale: float,
                  pairs_per_row: int, opts: dict, strides: tuple | None = None) -> None:
    # the split launch over a work list (items [num_items]: segment keys, -1 past the end); strides (q, k, v) when
    # the caller has read them (host time)
    qs, ks, vs = strides or (q.stride(), k_cache.stride(), v_cache.stride())
    args = (items, q, k_cache, v_cache, page_tables, positions, seg_start, prog_end, perm, part_o, part_lse,
            qs[0], qs[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], page_tables.stride(0), pairs_per_prog,
            num_requests, width, float(scale) * _LOG2E)
    consts = dict(G=q.shape[1] // k_cache.shape[2], SUB=_pow2_sub(opts), D=q.shape[2], PS=k_cache.shape[1],
                  BLOCK_N=opts["block_n"], PAIRS_PER_ROW=pairs_per_row,
                  DOT_FP32=torch.float32 in (q.dtype, k_cache.dtype), MASK_BRANCH=bool(opts["mask_branch"]),
                  EVICT_FIRST=bool(opts["evict_first"]))
    _SPLIT((num_items,), args, consts, num_warps=opts["num_warps"], num_stages=opts["num_stages"])


def merge(block_ids: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The merge launch of one slice of rows: out [n, Hq, D] from the slice's partials."""
    n, hq, d = out.shape
    hkv, topk = block_ids.shape[1], block_ids.shape[2]
    runnable(_merge_kernel, out.device)[(n, hkv)](
        block_ids, part_o, part_lse, out, block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1),
        G=hq // hkv, D=d, HKV=hkv, TOPK=topk, BLOCK_TOPK=max(2, next_pow2(topk)), num_warps=4)
    return out


def _rows(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    # a slice's rows; the tensor itself when the slice holds them all (a view costs host time, P11)
    return x if a == 0 and b == x.shape[0] else x[a:b]


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
    if opts["fused"]:
        part_o, part_lse = _kept_partials(rows * hkv * topk * group, d, q.dtype, q.device)
    else:
        part_o = torch.empty((rows * hkv * topk * group, d), dtype=q.dtype, device=q.device)
        part_lse = torch.empty((rows * hkv * topk * group,), dtype=torch.float32, device=q.device)
    for a in range(0, n, max_rows):
        b = min(n, a + max_rows)
        if opts["fused"]:
            fused_split(_rows(q, a, b), k_cache, v_cache, page_tables, query_start_loc, _rows(positions, a, b),
                        _rows(block_ids, a, b), a, num_requests, scale, part_o, part_lse, opts)
            merge(_rows(block_ids, a, b), part_o, part_lse, _rows(out, a, b))
            continue
        work = build_work_list(_rows(block_ids, a, b), query_start_loc, a, num_requests, page_tables.shape[1],
                               opts["pairs"])
        split_merge(_rows(q, a, b), k_cache, v_cache, page_tables, _rows(positions, a, b), _rows(block_ids, a, b),
                    scale, work, _rows(out, a, b), part_o, part_lse, opts)
    return out


__all__ = ["BLOCK_MAJOR_RULE", "SPLIT_LAUNCH", "WorkList", "build_work_list", "fused_split", "merge",
           "prefill_sparse_split", "release_workspace", "split_merge", "split_options", "use_block_major",
           "workspace_bytes"]
