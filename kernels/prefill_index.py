"""The MSA prefill indexer: block scores and top-k block selection for every prompt row, in bounded memory.

Semantics are `index_topk_ref`'s (kernels/index_topk.py): per query token at position p and index head r,
score(b) = max over keys j <= p of block b of <q_idx[r], index_k[j]> (fp32, no scale), the local blocks forced
in, the top min(topk, p // bs + 1) blocks by (score descending, block id ascending), emitted ascending, -1 tail.

Nothing of size [rows, heads, blocks] is stored: program (tile, request, split) takes BT consecutive prompt
tokens of one request and every local index head (M = BT * Hi rows; the index-K is one head, so all rows share
each K tile), walks blocks s, s + S, s + 2S, ... up to its last token's block, and keeps a running top-k per row
in registers: a new block (always the highest id seen so far) replaces the row's worst entry (lowest score, ties:
the highest id) only when its score is strictly higher, which is exactly the reference's stable order. With
S = 1 the program emits its lists directly (ascending by rank); with S > 1 each split writes its list (scores
and ids) and `_merge_kernel` takes the top-k of the S lists by the same order. Splits give short tiles of long
contexts more programs (T = 2,048 rows are only 128 tiles of 16 tokens).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, num_sms, runnable, step_jit

# ids of empty list slots are BIG + slot (unique, so a replacement hits exactly one slot); a constexpr: jit code
# reads it
_BIG = tl.constexpr(1 << 30)


@triton.jit
def _insert(vals, ids, s, b):
    # vals/ids [M, K] the running lists; s [M] block b's scores (-inf: not visible to the row). The row's worst
    # entry is the lowest score, ties to the highest id; b (higher than every id held) takes its slot iff s > it.
    worst = tl.min(vals, axis=1)
    wid = tl.max(tl.where(vals == worst[:, None], ids, -1), axis=1)
    take = (s > worst) & (s > float("-inf"))
    slot = (ids == wid[:, None]) & take[:, None]
    return tl.where(slot, s[:, None], vals), tl.where(slot, b, ids).to(tl.int32)  # b may be int64


@triton.jit
def _emit(out_rows, ok, vals, ids, K_REAL: tl.constexpr, BK: tl.constexpr):
    # the held ids of each row in ascending order, then -1: an entry's slot is its rank among the row's real ids
    real = (ids < _BIG) & (vals > float("-inf")) & ok[:, None]
    key = tl.where(real, ids, _BIG)
    rank = tl.sum((key[:, None, :] < key[:, :, None]).to(tl.int32), axis=2)
    tl.store(out_rows + rank, key.to(tl.int32), mask=real)
    count = tl.sum(real.to(tl.int32), axis=1)
    k = tl.arange(0, BK)
    tl.store(out_rows + k[None, :], tl.full(key.shape, -1, tl.int32),
             mask=ok[:, None] & (k[None, :] >= count[:, None]) & (k[None, :] < K_REAL))


@step_jit(ints=("pt_st_r", "num_tiles", "num_splits"), ptrs=("pt_ptr", "qsl_ptr", "pos_ptr"))
def _prefill_index_kernel(q_ptr, kc_ptr, pt_ptr, qsl_ptr, pos_ptr, out_ptr, pv_ptr, pi_ptr,
                          q_st_n, q_st_h, kc_st_p, kc_st_o, pt_st_r, out_st_n, out_st_h,
                          p_st_n, p_st_h, p_st_s, local_blocks, num_tiles, num_splits,
                          HI: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, DI: tl.constexpr,
                          PS: tl.constexpr, TOPK: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                          ONE_SPLIT: tl.constexpr):
    tile = num_tiles - 1 - tl.program_id(0)  # long (late) tiles first
    r = tl.program_id(1)
    s = tl.program_id(2)
    row_end = tl.load(qsl_ptr + r + 1)
    row0 = tl.load(qsl_ptr + r) + tile * BT
    if row0 >= row_end:
        return
    BM: tl.constexpr = BT * HP
    m = tl.arange(0, BM)
    rows = row0 + m // HP
    h = m % HP
    ok = (rows < row_end) & (h < HI)
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, DI)
    pos = tl.load(pos_ptr + rows, mask=ok, other=-1).to(tl.int64)
    own = tl.where(ok, pos // PS, -1)
    q = tl.load(q_ptr + rows64[:, None] * q_st_n + h[:, None] * q_st_h + d[None, :], mask=ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    last_block = tl.max(pos, axis=0) // PS
    key = tl.arange(0, PS)
    pt_row = pt_ptr + r.to(tl.int64) * pt_st_r
    k = tl.arange(0, BK)
    vals = tl.where(k[None, :] < TOPK, float("-inf"), float("inf")) + tl.zeros([BM, BK], tl.float32)
    ids = _BIG + k[None, :] + tl.zeros([BM, BK], tl.int32)
    for b in range(s, last_block + 1, num_splits):
        page = tl.load(pt_row + b).to(tl.int64)
        kt = tl.load(kc_ptr + page * kc_st_p + key[None, :] * kc_st_o + d[:, None])  # K^T [DI, PS]
        if DOT_FP32:
            qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = tl.where((b * PS + key)[None, :] <= pos[:, None], qk, float("-inf"))
        sc = tl.max(qk, axis=1)
        sc = tl.where((b >= own - local_blocks + 1) & (b <= own), float("inf"), sc)
        vals, ids = _insert(vals, ids, sc, b)
    if ONE_SPLIT:
        _emit(out_ptr + rows64[:, None] * out_st_n + h[:, None] * out_st_h, ok, vals, ids, TOPK, BK)
    else:
        dst = rows64[:, None] * p_st_n + h[:, None] * p_st_h + s * p_st_s + k[None, :]
        tl.store(pv_ptr + dst, vals, mask=ok[:, None])
        tl.store(pi_ptr + dst, ids, mask=ok[:, None])


@step_jit(ints=("num_splits",))
def _merge_kernel(pv_ptr, pi_ptr, out_ptr, p_st_n, p_st_h, p_st_s, out_st_n, out_st_h, num_splits,
                  HI: tl.constexpr, TOPK: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    # program (row, head): the top-k of the splits' lists [S * BK] by (score desc, id asc), emitted ascending
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, BC)
    live = c < num_splits * BK
    src = n * p_st_n + h * p_st_h + (c // BK) * p_st_s + c % BK
    v = tl.load(pv_ptr + src, mask=live, other=float("-inf"))
    i = tl.load(pi_ptr + src, mask=live, other=_BIG)
    real = (i < _BIG) & (v > float("-inf"))
    v = tl.where(real, v, float("-inf"))
    i = tl.where(real, i, _BIG + c)
    beats = (v[None, :] > v[:, None]) | ((v[None, :] == v[:, None]) & (i[None, :] < i[:, None]))
    chosen = (tl.sum(beats.to(tl.int32), axis=1) < TOPK) & real
    key = tl.where(chosen, i, _BIG)
    rank = tl.sum(((key[None, :] < key[:, None]) & chosen[None, :]).to(tl.int32), axis=1)
    row = out_ptr + n * out_st_n + h * out_st_h
    tl.store(row + rank, key, mask=chosen)
    count = tl.sum(chosen.to(tl.int32), axis=0)
    k = tl.arange(0, BK)
    tl.store(row + k, tl.full([BK], -1, tl.int32), mask=(k >= count) & (k < TOPK))


# rows per program (tokens x index heads) and launch options (benchmarks/kernels/bench_prefill.py sweeps them)
PREFILL_INDEX_LAUNCH = {"rows": 64, "num_warps": 4, "num_stages": 2, "splits": None}


def default_index_splits(num_tiles: int, max_blocks: int, device: torch.device) -> int:
    """Splits of the block axis so tiles * splits ~ 1.5x the SMs, each split keeping >= 16 blocks (H200, T = 2,048
    at 32k context: 2 splits 0.28 ms, 3 splits 0.34, 1 split 0.35)."""
    want = -(-3 * num_sms(device) // max(2 * num_tiles, 1))
    return max(1, min(want, max_blocks // 16))


def prefill_index_topk(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor,
                       query_start_loc: torch.Tensor, positions: torch.Tensor, topk: int, local_blocks: int, *,
                       num_requests: int, max_len: int, out: torch.Tensor | None = None,
                       launch: dict | None = None) -> torch.Tensor:
    """Selections of the rows of requests [0, num_requests) -> int32 [rows, Hi, topk] (ascending, -1 tail).

    q_idx [N, Hi, Di]: the prompt rows only, N = query_start_loc[num_requests]; index_k_cache [P, ps, Di];
    page_tables [>= num_requests, max_pages] int32; query_start_loc [>= num_requests + 1] int32 (device, from 0);
    positions [>= N]; max_len: the longest request's row count (host int). `out` may be a view (the prefill prefix of a mixed batch's output). No host syncs; scratch of
    rows * Hi * splits * next_pow2(topk) * 8 bytes only when the block axis is split.
    """
    n, hi, di = q_idx.shape
    ps = index_k_cache.shape[1]
    if out is None:
        out = torch.empty((n, hi, topk), dtype=torch.int32, device=q_idx.device)
    if num_requests == 0 or max_len == 0:
        return out
    if q_idx.stride(-1) != 1 or index_k_cache.stride(-1) != 1 or page_tables.stride(-1) != 1:
        raise ValueError("prefill index: q_idx, index_k_cache and page_tables need a unit last stride")
    if di & (di - 1) or ps & (ps - 1) or di < 16 or ps < 16:
        raise ValueError(f"prefill index: index_head_dim {di} and page_size {ps} must be powers of two >= 16")
    if query_start_loc.dtype != torch.int32 or query_start_loc.numel() < num_requests + 1:
        raise ValueError("prefill index: query_start_loc must be int32 [>= num_requests + 1]")
    opts = dict(PREFILL_INDEX_LAUNCH)
    opts.update(launch or {})
    hp = next_pow2(hi)
    bt = max(1, opts.pop("rows") // hp)
    if bt * hp < 16:
        bt = -(-16 // hp)
    num_tiles = -(-max_len // bt)
    splits = opts.pop("splits") or default_index_splits(num_tiles * num_requests, page_tables.shape[1],
                                                        q_idx.device)
    bk = max(2, next_pow2(topk))
    one = splits == 1
    if one:
        pv = pi = out  # unused
        p_st = (0, 0, 0)
    else:
        pv = torch.empty((n, hi, splits, bk), dtype=torch.float32, device=q_idx.device)
        pi = torch.empty((n, hi, splits, bk), dtype=torch.int32, device=q_idx.device)
        p_st = pv.stride()[:3]
    dot_fp32 = torch.float32 in (q_idx.dtype, index_k_cache.dtype)
    runnable(_prefill_index_kernel, q_idx.device)[(num_tiles, num_requests, splits)](
        q_idx, index_k_cache, page_tables, query_start_loc, positions, out, pv, pi,
        q_idx.stride(0), q_idx.stride(1), index_k_cache.stride(0), index_k_cache.stride(1), page_tables.stride(0),
        out.stride(0), out.stride(1), *p_st, local_blocks, num_tiles, splits,
        HI=hi, HP=hp, BT=bt, DI=di, PS=ps, TOPK=topk, BK=bk, DOT_FP32=dot_fp32, ONE_SPLIT=one, **opts)
    if not one:
        runnable(_merge_kernel, q_idx.device)[(n, hi)](
            pv, pi, out, *p_st, out.stride(0), out.stride(1), splits,
            HI=hi, TOPK=topk, BK=bk, BC=next_pow2(splits * bk), num_warps=4)
    return out


__all__ = ["prefill_index_topk", "PREFILL_INDEX_LAUNCH", "default_index_splits"]
