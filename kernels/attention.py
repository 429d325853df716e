"""Paged attention over any rows (prefill chunks and decode rows alike): dense causal and MSA block-sparse.

The launchers route a step's rows: prompt rows to the prefill kernel `prompt_kind` picks (dense or token-major sparse
in kernels/prefill_attention.py, block-major sparse in kernels/prefill_sparse_split.py), decode rows (the batch
suffix) to the decode kernel here; `paged_attention_ref` is the torch reference of all. Off CUDA the
launchers' default is the CPU serving path: prompt rows by the reference, decode rows all at once in torch
(`paged_decode_attention_torch`, masked SDPA; no library takes paged MSA selections).

Each row is one query token at absolute position p of request `row_seq[row]`; it sees that request's keys
j <= p (token-level causal mask), read from the paged caches through `page_tables`. For sparse layers it sees
only keys in the blocks that its KV group selected (`block_ids` [N, Hkv, topk], ascending, -1 padded).
The current step's K/V must already be in the cache (write first, then attend).

Decode path (Triton): `_decode_attn_kernel` runs flash-decoding on a grid (decode rows, KV heads, splits); one
program holds the G query heads of one KV group (they share every K/V tile, so a tile is read once for the group)
and walks its share of the row's blocks: for sparse layers the selected ids i = s, s + S, ... of
block_ids[row, kv_head] (ascending, -1 tail), for dense layers the blocks s, s + S, ... up to the row's own block.
Keys past the row's position are masked token by token. A tile enters the program's online softmax with the
heads as the products' M side (`_tile_heads_major`) or, as an option, the keys (`_tile_keys_major`: K q^T and
V^T P^T, which Hopper runs on wgmma). With S > 1 each split leaves a normalised partial and
its log-sum-exp, combined (a split with no block leaves lse = -inf and weighs nothing) either by `_merge_kernel`
or, for a few splits, by the last program of the (row, KV head) to finish (an atomic arrival counter that the
merging program resets), which saves the merge launch. With S = 1 the kernel writes the output directly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._paged import gather_context, gather_row_contexts, prefill_layout, request_rows
from kernels._triton import (arrival_counters, next_pow2, num_sms, pdl_enter, pdl_launch, runnable, step_jit,
                             use_triton)
from kernels.prefill_attention import _softmax_update, prefill_attention
from kernels.prefill_sparse_split import prefill_sparse_split, use_block_major


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                        row_seq: torch.Tensor, positions: torch.Tensor, scale: float,
                        block_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D]; k/v_cache [P, ps, Hkv, D]; block_ids None (dense) or [N, Hkv, topk] -> out [N, Hq, D]."""
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    for r, rows in request_rows(row_seq):
        pos = positions[rows].to(torch.long)
        ctx = int(pos.max()) + 1
        k = gather_context(k_cache, page_tables[r], ctx).float()  # [L, Hkv, D]
        v = gather_context(v_cache, page_tables[r], ctx).float()
        # query head h reads KV head h // group
        scores = torch.einsum("nhd,lhd->nhl", q[rows].float(), k.repeat_interleave(group, dim=1)) * scale
        keys = torch.arange(ctx, device=q.device)
        allowed = (keys[None, :] <= pos[:, None])[:, None, :].expand(len(rows), hq, ctx)
        if block_ids is not None:
            allowed = allowed & _selected_keys(block_ids[rows], ctx, ps).repeat_interleave(group, dim=1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("nhl,lhd->nhd", probs, v.repeat_interleave(group, dim=1)).to(q.dtype)
    return out


def paged_decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 page_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                                 scale: float, block_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU serving path for decode rows: `paged_attention_ref`'s result for rows that each stand alone (shapes
    as there), every row at once: one gather of the rows' contexts up to the longest, one masked SDPA (the
    reference loops over requests, ~0.2 ms of small ops each per layer on the CPU: a tiny-model step at 16
    streams was ~40% attention). One host sync (the longest row)."""
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    if n == 0:
        return torch.empty_like(q)
    pos = positions.to(torch.long)
    ctx = int(pos.max()) + 1
    k = gather_row_contexts(k_cache, page_tables, row_seq, ctx).float().transpose(1, 2)  # [N, Hkv, L, D]
    v = gather_row_contexts(v_cache, page_tables, row_seq, ctx).float().transpose(1, 2)
    allowed = (torch.arange(ctx, device=q.device)[None, :] <= pos[:, None])[:, None, :]  # [N, 1, L]
    if block_ids is not None:
        allowed = allowed & _selected_keys(block_ids, ctx, ps)  # [N, Hkv, L]
    # [N, Hkv or 1, L] -> [N, Hq or 1, 1, L]: query head h reads KV head h // group
    mask = allowed.repeat_interleave(hq // hkv, dim=1) if allowed.shape[1] > 1 else allowed
    out = torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None, :], k, v, attn_mask=mask[:, :, None],
                                                           scale=scale, enable_gqa=True)
    return out[:, :, 0].to(q.dtype)


def _selected_keys(block_ids: torch.Tensor, ctx: int, ps: int) -> torch.Tensor:
    """[n, Hkv, topk] block ids -> bool [n, Hkv, ctx]: key j lies in a selected block."""
    nb = -(-ctx // ps)
    safe = torch.where(block_ids < 0, torch.full_like(block_ids, nb), block_ids).to(torch.long)
    sel = torch.zeros(*block_ids.shape[:2], nb + 1, dtype=torch.bool, device=block_ids.device)
    sel.scatter_(-1, safe, True)
    return sel[..., :nb].repeat_interleave(ps, dim=-1)[..., :ctx]


def _check(q, k_cache, v_cache, row_seq, positions, block_ids) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention: q {tuple(q.shape)} must be [N, Hq, D], caches [P, ps, Hkv, D]")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"attention: q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)}")
    if row_seq.shape != (q.shape[0],) or positions.shape != (q.shape[0],):
        raise ValueError("attention: row_seq and positions must be [N]")
    if block_ids is not None and block_ids.shape[:2] != (q.shape[0], k_cache.shape[2]):
        raise ValueError(f"attention: block_ids {tuple(block_ids.shape)} must be [N, Hkv, topk]")




@step_jit(ints=("pt_st_r", "num_splits"), ptrs=("row_seq_ptr", "pos_ptr", "pt_ptr"))
def _decode_attn_kernel(q_ptr, kc_ptr, vc_ptr, pt_ptr, row_seq_ptr, pos_ptr, bid_ptr, pid_ptr, o_ptr, po_ptr,
                        plse_ptr, q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r,
                        bid_st_n, bid_st_h, o_st_n, o_st_h, po_st_n, po_st_h, po_st_s, pl_st_n, pl_st_h,
                        qk_scale_log2, num_splits, cnt_ptr,
                        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                        BLOCK_N: tl.constexpr,
                        TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, SPARSE: tl.constexpr,
                        ONE_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRELOAD: tl.constexpr,
                        PAGE_IDS: tl.constexpr, FOLD_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
                        SWAP: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    req = tl.load(row_seq_ptr + n).to(tl.int64)
    p = tl.load(pos_ptr + n).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK_N)
    SUB: tl.constexpr = PS // BLOCK_N  # tiles per block: smaller tiles keep more loads in flight per SM
    heads = kvh * G + g
    q = tl.load(q_ptr + n * q_st_n + heads[:, None] * q_st_h + d[None, :], mask=(g < G)[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if SPARSE:
        # selected ids are ascending with a -1 tail: the first `count` entries are the blocks to read
        kk = tl.arange(0, BLOCK_TOPK)
        ids = tl.load(bid_ptr + n * bid_st_n + kvh * bid_st_h + kk, mask=kk < TOPK, other=-1)
        count = tl.sum((ids >= 0).to(tl.int32), axis=0)
        if PRELOAD:
            # the row's page ids in one gather up front: only the K/V tile loads stay on the loop's chain. Given
            # by the indexer (PAGE_IDS) they load beside the block ids, else through the page table after them
            if PAGE_IDS:
                pages = tl.load(pid_ptr + n * bid_st_n + kvh * bid_st_h + kk, mask=kk < TOPK, other=0)
            else:
                pages = tl.load(pt_ptr + req * pt_st_r + ids, mask=ids >= 0, other=0)
    else:
        count = p // PS + 1
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SWAP:
        acc = tl.zeros([D, BLOCK_G], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, D], tl.float32)
    bid_row = bid_ptr + n * bid_st_n + kvh * bid_st_h
    pid_row = pid_ptr + n * bid_st_n + kvh * bid_st_h
    pt_row = pt_ptr + req * pt_st_r
    for i in range(s, count * SUB, num_splits):
        j = i // SUB
        if SPARSE:
            if PRELOAD:
                sel = kk == j
                b = tl.sum(tl.where(sel, ids, 0), axis=0).to(tl.int64)
                page = tl.sum(tl.where(sel, pages, 0), axis=0).to(tl.int64)
            elif PAGE_IDS:
                b = tl.load(bid_row + j).to(tl.int64)
                page = tl.load(pid_row + j).to(tl.int64)
            else:
                b = tl.load(bid_row + j).to(tl.int64)
                page = tl.load(pt_row + b).to(tl.int64)
        else:
            b = j
            page = tl.load(pt_row + b).to(tl.int64)
        tok = (i % SUB) * BLOCK_N + t
        k = tl.load(kc_ptr + page * kc_st_p + tok[:, None] * kc_st_o + kvh * kc_st_h + d[None, :])
        v = tl.load(vc_ptr + page * vc_st_p + tok[:, None] * vc_st_o + kvh * vc_st_h + d[None, :])
        if SWAP:
            m_i, l_i, acc = _tile_keys_major(q, k, v, (b * PS + tok) <= p, m_i, l_i, acc, qk_scale_log2, DOT_FP32)
        else:
            m_i, l_i, acc = _tile_heads_major(q, k, v, (b * PS + tok) <= p, m_i, l_i, acc, qk_scale_log2, DOT_FP32)
    if SWAP:
        acc = tl.trans(acc)
    # an empty split keeps l = 0: divide by 1 and report lse = -inf so the merge gives it no weight
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if ONE_SPLIT:
        tl.store(o_ptr + n * o_st_n + heads[:, None] * o_st_h + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(po_ptr + n * po_st_n + heads[:, None] * po_st_h + s * po_st_s + d[None, :], out,
                 mask=(g < G)[:, None])
        tl.store(plse_ptr + n * pl_st_n + heads * pl_st_h + s, lse, mask=g < G)
        if FOLD_MERGE:
            # the last split of (row, KV head) to arrive merges the partials (no merge launch). The barrier +
            # release add publish this program's partial; the counter is reset for the next call.
            tl.debug_barrier()
            cnt = cnt_ptr + n * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                tl.atomic_xchg(cnt, 0)
                _merge_group(po_ptr + n * po_st_n, plse_ptr + n * pl_st_n, o_ptr + n * o_st_n, heads, g < G,
                             po_st_h, po_st_s, pl_st_h, o_st_h, num_splits, D, BLOCK_S)


@triton.jit
def _tile_heads_major(q, k, v, keep, m_i, l_i, acc, qk_scale_log2, DOT_FP32: tl.constexpr):
    """One K/V tile into a program's running softmax: q [BG, D], k / v [BN, D], keep [BN] (keys the row sees),
    m_i / l_i [BG], acc [BG, D]; the heads are the products' M side (mma.sync at 16 heads)."""
    if DOT_FP32:
        qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)))
    qk = tl.where(keep[None, :], qk * qk_scale_log2, float("-inf"))
    return _softmax_update(qk, v.to(q.dtype), m_i, l_i, acc, DOT_FP32)  # the prefill kernels' update


@triton.jit
def _tile_keys_major(q, k, v, keep, m_i, l_i, acc, qk_scale_log2, DOT_FP32: tl.constexpr):
    """`_tile_heads_major` with the products swapped, S^T = K q^T and O^T += V^T P^T: the tile's keys are the M
    side (64+ rows, where Hopper's wgmma applies; 16 heads are only N). acc [D, BG], transposed."""
    if DOT_FP32:
        st = tl.dot(k.to(tl.float32), tl.trans(q), input_precision="ieee")
    else:
        st = tl.dot(k.to(q.dtype), tl.trans(q))  # [BN, BG]
    st = tl.where(keep[:, None], st * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    pt = tl.exp2(st - m_use[None, :])
    l_i = l_i * alpha + tl.sum(pt, axis=0)
    if DOT_FP32:
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float32)), pt, input_precision="ieee")
    else:
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v.to(q.dtype)), pt.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def _merge_group(po_row, pl_row, o_row, heads, ok, po_st_h, po_st_s, pl_st_h, o_st_h, num_splits,
                 D: tl.constexpr, BLOCK_S: tl.constexpr):
    # heads [BG] of one row: out = sum_s 2^(lse_s - m) part_s / sum_s 2^(lse_s - m). `.cg` reads: the partials
    # come from other programs of this launch. The split loop is unrolled so its loads are all in flight.
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    lse = tl.load(pl_row + heads[:, None] * pl_st_h + sp[None, :], mask=ok[:, None] & (sp < num_splits)[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [BG, BS]
    m = tl.max(lse, axis=1)
    m = tl.where(m > float("-inf"), m, 0.0)
    total = tl.sum(tl.exp2(lse - m[:, None]), axis=1)
    acc = tl.zeros([heads.shape[0], D], tl.float32)
    for s in tl.static_range(BLOCK_S):
        lse_s = tl.load(pl_row + heads * pl_st_h + s, mask=ok & (s < num_splits), other=float("-inf"),
                        cache_modifier=".cg")
        # every split stores its partial (zeros when empty), so its load need not wait for the lse
        part = tl.load(po_row + heads[:, None] * po_st_h + s * po_st_s + d[None, :],
                       mask=(ok & (s < num_splits))[:, None], other=0.0, cache_modifier=".cg")
        acc += part * tl.exp2(lse_s - m)[:, None]
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(o_row + heads[:, None] * o_st_h + d[None, :], out.to(o_row.dtype.element_ty), mask=ok[:, None])


@step_jit(ints=("num_splits",))
def _merge_kernel(po_ptr, plse_ptr, o_ptr, po_st_n, po_st_h, po_st_s, pl_st_n, pl_st_h, o_st_n, o_st_h,
                  num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    # program (n, h): combine the split partials of one row and query head by their log-sum-exp (base 2)
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    lse = tl.load(plse_ptr + n * pl_st_n + h * pl_st_h + sp, mask=sp < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    # every split stores its partial (zeros when empty): the load need not wait for the lse's
    part = tl.load(po_ptr + n * po_st_n + h * po_st_h + sp[:, None] * po_st_s + d[None, :],
                   mask=(sp < num_splits)[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + n * o_st_n + h * o_st_h + d, out.to(o_ptr.dtype.element_ty))


_LOG2E = 1.4426950408889634
# launch options of the decode kernel (benchmarks/kernels/bench_decode.py sweeps them on the GPU)
# block_n_walk: the key tile of a sparse program that walks several blocks. Smaller tiles let 2 programs' pipeline
# stages share an SM with the page ids preloaded (H200, B = 16, 4 splits, folded merge, two runs: 64-key tiles,
# 3 stages, preloaded 24.9 / 25.1 us; 128-key tiles, ids in the loop 25.9 / 26.3; docs/benchmarks.md "Sparse
# decode, where the time goes"). One tile a program (B = 1) keeps block_n.
ATTN_LAUNCH = {"num_warps": 4, "num_stages": 3, "block_n": 128, "block_n_walk": 64}
# preload None: a sparse program gathers its page ids up front when it reads one tile (H200, B=1: 7.8 vs 8.3 us)
# or walks block_n_walk tiles; with several 128-key tiles it costs registers (B=16 31.2 vs 30.0, B=64 75.3 vs
# 72.1). fold_merge None: the last split of a (row, KV head) merges the partials (no merge launch) up to
# MAX_FOLD_SPLITS splits (B=16, 3 splits: 27.7 vs 30.0 us); with more splits one program would merge what the
# merge kernel spreads over G (B=1, 16 splits: 11.9 vs 8.3 us). True/False force either.
# swap: each tile's products as K q^T and V^T P^T (`_tile_keys_major`, wgmma on Hopper). Off: H200 (docs/benchmarks.md
# K1) 6.4 / 25.8 / 71.3 us at B = 1 / 16 / 64 against 6.4 / 25.5 / 74.1 for the heads-major products, one run
ATTN_OPTS = {"preload": None, "fold_merge": None, "swap": False}
MAX_FOLD_SPLITS = 4


def default_attn_splits(num_rows: int, num_kv_heads: int, max_tiles: int, device: torch.device, *,
                        sparse: bool = False) -> int:
    """Splits of the tile axis, capped by the tiles there are: rows * kv_heads * splits ~ the SM count for dense
    layers, ~ 1.5x for sparse ones (H200 sweeps in docs/benchmarks.md; sparse: 16/4/1 splits best at
    B = 1/16/64 with 4 KV heads and top-16)."""
    sms = 3 * num_sms(device) // 2 if sparse else num_sms(device)
    want = -(-sms // max(num_rows * num_kv_heads, 1))
    return max(1, min(want, max_tiles))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                           row_seq: torch.Tensor, positions: torch.Tensor, scale: float,
                           block_ids: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                           num_splits: int | None = None, fold_merge: bool | None = None,
                           preload: bool | None = None, page_ids: torch.Tensor | None = None,
                           swap: bool | None = None) -> torch.Tensor:
    """Triton flash-decoding for rows [0, N) of its inputs (shapes as in `paged_attention_ref`); dense when
    block_ids is None. `page_ids` (sparse only, optional): the selected blocks' pages, [N, Hkv, topk] int32 with
    block_ids' strides (page_tables[row_seq[n], block_ids[n, h, i]] where that id is >= 0, anything in the -1 tail),
    so a tile's page is not looked up after its block id (-0.3 us of 6.4 at B = 1 on the H200; `index_topk(
    with_pages=True)` writes them, at a cost that outweighs this: msa/indexer.py WRITE_PAGES, off). `swap` None:
    ATTN_OPTS["swap"]. `out` [N, Hq, D] may be a view (the decode suffix of a mixed batch). No host syncs."""
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_tables", page_tables)):
        if x.stride(-1) != 1:
            raise ValueError(f"attention: {name} needs a unit stride on its last dim, got {x.stride()}")
    if d & (d - 1) or ps & (ps - 1) or d < 16 or ps < 16:
        raise ValueError(f"attention: head_dim {d} and page_size {ps} must be powers of two >= 16")
    group = hq // hkv
    sparse = block_ids is not None
    topk = block_ids.shape[-1] if sparse else 1
    launch = dict(ATTN_LAUNCH)
    block_n = min(launch.pop("block_n", ps), ps)
    walk_n = min(launch.pop("block_n_walk", block_n), block_n)
    if torch.float32 in (q.dtype, k_cache.dtype):
        # fp32 (parity runs): the bf16 tiles and stages would ask ~272 KB of shared memory at head_dim 128
        block_n, launch["num_stages"] = min(block_n, 64), min(launch["num_stages"], 2)
    blocks = topk if sparse else page_tables.shape[1]
    max_tiles = blocks * (ps // block_n)
    splits = num_splits or default_attn_splits(n, hkv, max_tiles, q.device, sparse=sparse)
    splits = max(1, min(splits, max_tiles))
    # a sparse program walking several tiles takes the smaller walk tile (same blocks a program: splits unchanged)
    walk = sparse and splits < max_tiles and walk_n < block_n
    if walk:
        block_n, max_tiles = walk_n, blocks * (ps // walk_n)
    one = splits == 1
    if one:
        po = plse = out  # unused
        po_st = (0, 0, 0)
        pl_st = (0, 0)
    else:
        po = torch.empty((n, hq, splits, d), dtype=torch.float32, device=q.device)
        plse = torch.empty((n, hq, splits), dtype=torch.float32, device=q.device)
        po_st, pl_st = po.stride()[:3], plse.stride()[:2]
    bid = block_ids if sparse else page_tables
    bid_st = (block_ids.stride(0), block_ids.stride(1)) if sparse else (0, 0)
    if sparse and block_ids.stride(-1) != 1:
        raise ValueError("attention: block_ids needs a unit last stride")
    dot_fp32 = torch.float32 in (q.dtype, k_cache.dtype)
    fold = ATTN_OPTS["fold_merge"] if fold_merge is None else fold_merge
    if fold is None:
        fold = sparse and splits <= MAX_FOLD_SPLITS
    counters = arrival_counters("attention", n * hkv, q.device, 4096) if fold and not one else None
    pre = ATTN_OPTS["preload"] if preload is None else preload
    pdl_opts, pdl = pdl_launch(q.device, "attention", n)
    if pre is None:
        pre = splits >= max_tiles or walk
    if page_ids is not None and (not sparse or page_ids.shape != block_ids.shape
                                 or page_ids.stride() != block_ids.stride() or page_ids.dtype != torch.int32):
        raise ValueError("attention: page_ids must be int32 with block_ids' shape and strides (sparse layers)")
    runnable(_decode_attn_kernel, q.device)[(n, hkv, splits)](
        q, k_cache, v_cache, page_tables, row_seq, positions, bid, bid if page_ids is None else page_ids, out, po,
        plse, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_tables.stride(0),
        bid_st[0], bid_st[1], out.stride(0), out.stride(1), *po_st, *pl_st,
        float(scale) * _LOG2E, splits, counters if counters is not None else plse,
        G=group, BLOCK_G=max(16, next_pow2(group)), D=d, PS=ps, BLOCK_N=block_n, TOPK=topk,
        BLOCK_TOPK=max(16, next_pow2(topk)), SPARSE=sparse, ONE_SPLIT=one, DOT_FP32=dot_fp32,
        PRELOAD=bool(pre and sparse), PAGE_IDS=page_ids is not None, FOLD_MERGE=counters is not None,
        BLOCK_S=max(2, next_pow2(splits)), SWAP=bool(ATTN_OPTS["swap"] if swap is None else swap), PDL=pdl,
        **launch, **pdl_opts)
    if not one and counters is None:
        runnable(_merge_kernel, q.device)[(n, hq)](
            po, plse, out, *po_st, *pl_st, out.stride(0), out.stride(1), splits,
            D=d, BLOCK_S=max(2, next_pow2(splits)), PDL=pdl, num_warps=4, **pdl_opts)
    return out


def prompt_kind(num_rows: int, num_requests: int, width: int, block_ids: torch.Tensor | None, num_kv_heads: int,
                fp32: bool = False) -> str:
    """The kernel for a step's prompt rows (host ints only, no sync): "dense" for dense layers, and for sparse ones
    whose page tables are at most top-k blocks wide: a table covers every position of its request, so no row has
    more visible blocks than that, the indexer selects them all, and MSA is dense causal attention exactly
    (M3_SPEC section 3; block_ids are then not read). Else "block_major" (kernels/prefill_sparse_split.py) where
    its rule says, "token_major" (kernels/prefill_attention.py) otherwise."""
    if block_ids is None or width <= block_ids.shape[-1]:
        return "dense"
    if use_block_major(num_rows, num_requests, width, block_ids.shape[-1], num_kv_heads, fp32):
        return "block_major"
    return "token_major"


def prompt_attention(q, k_cache, v_cache, page_tables, query_start_loc, positions, scale, block_ids=None, *,
                     num_requests: int, max_len: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The prompt rows of a step (`prefill_attention`'s inputs) through the kernel `prompt_kind` picks."""
    kind = prompt_kind(q.shape[0], num_requests, page_tables.shape[1], block_ids, k_cache.shape[2],
                       torch.float32 in (q.dtype, k_cache.dtype))
    if kind == "block_major":
        return prefill_sparse_split(q, k_cache, v_cache, page_tables, query_start_loc, positions, scale, block_ids,
                                    num_requests=num_requests, max_len=max_len, out=out)
    return prefill_attention(q, k_cache, v_cache, page_tables, query_start_loc, positions, scale,
                             None if kind == "dense" else block_ids, num_requests=num_requests, max_len=max_len,
                             out=out)


def _route(q, k_cache, v_cache, page_tables, row_seq, positions, scale, block_ids, num_prefill_rows, backend,
           num_splits, prefill, page_ids=None):
    if not 0 <= num_prefill_rows <= q.shape[0]:
        raise ValueError(f"attention: num_prefill_rows {num_prefill_rows} outside [0, {q.shape[0]}]")
    npf = num_prefill_rows
    if not use_triton(q.device, backend):
        if backend == "ref":
            return paged_attention_ref(q, k_cache, v_cache, page_tables, row_seq, positions, scale, block_ids)
        return _torch_route(q, k_cache, v_cache, page_tables, row_seq, positions, scale, block_ids, npf)
    out = torch.empty_like(q)
    if npf:
        qsl, num_requests, max_len = prefill if prefill is not None else prefill_layout(row_seq, npf)
        prompt_attention(q[:npf], k_cache, v_cache, page_tables, qsl, positions[:npf], scale,
                         None if block_ids is None else block_ids[:npf], num_requests=num_requests,
                         max_len=max_len, out=out[:npf])
    paged_decode_attention(q[npf:], k_cache, v_cache, page_tables, row_seq[npf:], positions[npf:], scale,
                           None if block_ids is None else block_ids[npf:], out=out[npf:], num_splits=num_splits,
                           page_ids=None if page_ids is None else page_ids[npf:])
    return out


def _torch_route(q, k_cache, v_cache, page_tables, row_seq, positions, scale, block_ids, npf):
    """Off CUDA by default: prompt rows by the reference (a few requests of many rows: its loop is cheap there),
    decode rows by `paged_decode_attention_torch`."""
    out = torch.empty_like(q)
    sl = slice(None, npf)
    if npf:
        out[sl] = paged_attention_ref(q[sl], k_cache, v_cache, page_tables, row_seq[sl], positions[sl], scale,
                                      None if block_ids is None else block_ids[sl])
    sl = slice(npf, None)
    out[sl] = paged_decode_attention_torch(q[sl], k_cache, v_cache, page_tables, row_seq[sl], positions[sl], scale,
                                           None if block_ids is None else block_ids[sl])
    return out


def dense_attention(q, k_cache, v_cache, page_tables, row_seq, positions, scale, *, num_prefill_rows=0,
                    backend: str | None = None, num_splits: int | None = None,
                    prefill: tuple[torch.Tensor, int, int] | None = None):
    """Public launcher, dense causal -> [N, Hq, D] in q's dtype.

    With `backend` resolving to Triton (None: on CUDA tensors; "triton" forces it, on CPU through the
    interpreter), rows [0, num_prefill_rows) (prompt chunks) take a prefill kernel (`prompt_attention`)
    and rows [num_prefill_rows, N) (decode rows, the batch suffix) the decode kernel; both spans are views, nothing
    is copied. `prefill` = (query_start_loc [R + 1] int32 device, R, longest chunk) of the prompt rows, as the
    model's metadata holds it; None derives it from row_seq (one host sync). None off CUDA: the CPU serving path
    (`_torch_route`); "ref": the torch reference for all rows.
    """
    _check(q, k_cache, v_cache, row_seq, positions, None)
    return _route(q, k_cache, v_cache, page_tables, row_seq, positions, scale, None, num_prefill_rows, backend,
                  num_splits, prefill)


def sparse_attention(q, k_cache, v_cache, page_tables, row_seq, positions, block_ids, scale, *,
                     num_prefill_rows=0, backend: str | None = None, num_splits: int | None = None,
                     prefill: tuple[torch.Tensor, int, int] | None = None, page_ids: torch.Tensor | None = None):
    """Public launcher, MSA block-sparse over block_ids [N, Hkv, topk] (ascending, -1 tail); spans as above.
    The block_ids are the indexer's (M3_SPEC section 3): where the page tables are at most top-k blocks wide the
    prompt rows are computed as dense causal attention, which that selection then equals (`prompt_kind`).
    `page_ids`: the decode rows' selected pages as `index_topk(with_pages=True)` writes them (the decode kernel's
    input of that name; the model passes none, msa/indexer.py WRITE_PAGES), read on the Triton path only."""
    _check(q, k_cache, v_cache, row_seq, positions, block_ids)
    return _route(q, k_cache, v_cache, page_tables, row_seq, positions, scale, block_ids, num_prefill_rows, backend,
                  num_splits, prefill, page_ids)
