"""Paged prefill attention: the prompt rows of a step (dense causal and MSA block-sparse), one Triton launch.

The prompt rows [0, num_prefill_rows) of a step are the chunks of R requests, request r's rows being
query_start_loc[r] .. query_start_loc[r + 1]; each request has its own cached prefix (chunked prefill, prefix-cache
hits) and its chunk may start anywhere in a block. This step's K/V are already in the cache (write first, then
attend), so every key is read from the paged cache through the request's page table. `paged_attention_ref`
(kernels/attention.py) is the reference.

Grid (query tiles, requests, head blocks), like FlashAttention's varlen grid: program (i, r, hb) takes BT
consecutive query tokens of request r (tile i, the longest-running tiles launched first) and HG query heads of one
KV group, so its M = BT * HG rows share every K/V tile it reads (row m = token m // HG, head m % HG). Online softmax
in base 2; nothing of size [T, H, context] exists.
- Dense (block_ids None): key tiles 0 .. the tile's last position; tiles wholly before the tile's first position
  need no mask, the diagonal ones mask key > position per row.
- Sparse: the heads of a KV group share each token's selection block_ids[row, kv_head] (ascending, -1 tail), so
  HG = G. The program walks the union of its BT tokens' selections in ascending block order; a token that did not
  select the current block masks it out (with random selections about 2.5x the useful dot work at BT = 4 and 8k
  context, for K/V tiles read once for four tokens instead of once per token). BT = 1 is the gather-per-token
  kernel (NSA's group-centric loop). The token-level causal mask applies inside each block.
Tiles, warps and stages are launch options (PREFILL_LAUNCH); benchmarks/kernels/bench_prefill.py sweeps them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, runnable, step_jit

_LOG2E = 1.4426950408889634
_BIG = tl.constexpr(1 << 30)  # "no block": sorts after every real block id (a constexpr: jit code reads it)


@triton.jit
def _raw_scores(q, k, DOT_FP32: tl.constexpr):
    # q [M, D] against a key tile k [BN, D] -> unscaled logits [M, BN] (fp32 parity runs: IEEE fp32 dots)
    if DOT_FP32:
        return tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _scores(q, k, qk_scale_log2, DOT_FP32: tl.constexpr):
    # q [M, D] against a key tile k [BN, D] -> base-2 logits [M, BN]
    return _raw_scores(q, k, DOT_FP32) * qk_scale_log2


@triton.jit
def _softmax_update(qk, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    # the online-softmax update of rows [M] by one tile's masked logits qk [M, BN] and values v [BN, D]
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # a row that sees no key of this tile (yet) keeps m = -inf: shift by 0 then, never by -inf
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tile_step(q, k_ptrs, v_ptrs, keys, pos, ok, m_i, l_i, acc, qk_scale_log2, DOT_FP32: tl.constexpr,
               MASK: tl.constexpr):
    # one key tile [BN] for the program's M rows. ok [M] (sparse: the row's token selected this block); keys [BN]
    # absolute key positions; pos [M] row positions (-1: padding row).
    qk = _scores(q, tl.load(k_ptrs), qk_scale_log2, DOT_FP32)
    if MASK:
        qk = tl.where((keys[None, :] <= pos[:, None]) & ok[:, None], qk, float("-inf"))
    return _softmax_update(qk, tl.load(v_ptrs), m_i, l_i, acc, DOT_FP32)


@step_jit(ints=("pt_st_r", "num_tiles"), ptrs=("pt_ptr", "qsl_ptr", "pos_ptr"))
def _prefill_attn_kernel(q_ptr, kc_ptr, vc_ptr, pt_ptr, qsl_ptr, pos_ptr, bid_ptr, o_ptr,
                         q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r,
                         bid_st_n, bid_st_h, o_st_n, o_st_h, qk_scale_log2, num_tiles,
                         G: tl.constexpr, HG: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
                         BLOCK_N: tl.constexpr, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                         SPARSE: tl.constexpr, DOT_FP32: tl.constexpr):
    tile = num_tiles - 1 - tl.program_id(0)  # long (late) tiles first: they bound the launch's tail
    r = tl.program_id(1)
    hb = tl.program_id(2)
    row_beg = tl.load(qsl_ptr + r)
    row_end = tl.load(qsl_ptr + r + 1)
    row0 = row_beg + tile * BT
    if row0 >= row_end:
        return
    BM: tl.constexpr = BT * HG
    kvh = hb // (G // HG)
    h0 = kvh * G + (hb % (G // HG)) * HG
    m = tl.arange(0, BM)
    rows = row0 + m // HG
    rmask = rows < row_end
    heads = h0 + m % HG
    d = tl.arange(0, D)
    rows64 = rows.to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    q = tl.load(q_ptr + rows64[:, None] * q_st_n + heads[:, None] * q_st_h + d[None, :], mask=rmask[:, None],
                other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    p_first = tl.min(tl.where(rmask, pos, 1 << 40), axis=0)  # rows are ascending in a chunk; min() needs no order
    p_last = tl.max(pos, axis=0)
    pt_row = pt_ptr + r.to(tl.int64) * pt_st_r
    n = tl.arange(0, BLOCK_N)
    k_col = kvh * kc_st_h + d[None, :]
    v_col = kvh * vc_st_h + d[None, :]
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    SUB: tl.constexpr = PS // BLOCK_N
    if SPARSE:
        # the BT tokens' selections [BT, K] (ascending, -1 tail) and their union, ascending: an entry joins the
        # union where no earlier token holds the same id (first occurrence), then ranks among the joiners
        TK: tl.constexpr = BT * BLOCK_TOPK
        t = tl.arange(0, BT)
        kk = tl.arange(0, BLOCK_TOPK)
        trow = row0 + t
        sel = tl.load(bid_ptr + trow.to(tl.int64)[:, None] * bid_st_n + kvh * bid_st_h + kk[None, :],
                      mask=(trow < row_end)[:, None] & (kk < TOPK)[None, :], other=-1)
        sel = tl.where(sel >= 0, sel, _BIG)
        flat = tl.reshape(sel, [TK])
        e = tl.arange(0, TK)
        tok_of = e // BLOCK_TOPK
        same = (flat[:, None] == flat[None, :]) & (tok_of[None, :] < tok_of[:, None])
        first = (tl.sum(same.to(tl.int32), axis=1) == 0) & (flat < _BIG)
        uid = tl.where(first, flat, _BIG)
        rank = tl.sum(((uid[None, :] < uid[:, None]) & first[None, :]).to(tl.int32), axis=1)
        count = tl.sum(first.to(tl.int32), axis=0)
        tok = m // HG
        for u in range(0, count * SUB):
            j = u // SUB
            b = tl.sum(tl.where(first & (rank == j), uid, 0), axis=0)
            # which of the BT tokens selected block b -> per row
            hit = tl.sum((sel == b).to(tl.int32), axis=1) > 0  # [BT]
            ok = tl.sum(tl.where(tok[:, None] == t[None, :], hit[None, :].to(tl.int32), 0), axis=1) > 0
            page = tl.load(pt_row + b).to(tl.int64)
            off = (u % SUB) * BLOCK_N + n
            keys = b.to(tl.int64) * PS + off
            m_i, l_i, acc = _tile_step(q, kc_ptr + page * kc_st_p + off[:, None] * kc_st_o + k_col,
                                       vc_ptr + page * vc_st_p + off[:, None] * vc_st_o + v_col,
                                       keys, pos, ok, m_i, l_i, acc, qk_scale_log2, DOT_FP32, True)
    else:
        ok = rmask
        # key tiles wholly at or before the lowest row position: no row masks any of their keys
        full = (p_first + 1) // BLOCK_N
        for j in range(0, full):
            page = tl.load(pt_row + (j // SUB)).to(tl.int64)
            off = (j % SUB) * BLOCK_N + n
            m_i, l_i, acc = _tile_step(q, kc_ptr + page * kc_st_p + off[:, None] * kc_st_o + k_col,
                                       vc_ptr + page * vc_st_p + off[:, None] * vc_st_o + v_col,
                                       j * BLOCK_N + n, pos, ok, m_i, l_i, acc, qk_scale_log2, DOT_FP32, False)
        for j in range(full, p_last // BLOCK_N + 1):
            page = tl.load(pt_row + (j // SUB)).to(tl.int64)
            off = (j % SUB) * BLOCK_N + n
            m_i, l_i, acc = _tile_step(q, kc_ptr + page * kc_st_p + off[:, None] * kc_st_o + k_col,
                                       vc_ptr + page * vc_st_p + off[:, None] * vc_st_o + v_col,
                                       j * BLOCK_N + n, pos, ok, m_i, l_i, acc, qk_scale_log2, DOT_FP32, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows64[:, None] * o_st_n + heads[:, None] * o_st_h + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


# Launch options per kind: tokens per program (BT), query heads per program (HG; "group" = the whole KV group),
# keys per tile, warps, stages. The sparse kernel always holds the whole group (heads share the selection), and
# its tokens None picks BT by the table's blocks (`sparse_tokens`). benchmarks/kernels/bench_prefill.py sweeps
# them on the H200; docs/benchmarks.md has the sweep behind the choice (dense: 8 x 16 rows of 128 keys, 8 warps,
# 3 stages was best at 8k and within 1% at 32k; sparse: 4 tokens best at 8k context, 1 token at 32k).
PREFILL_LAUNCH = {
    "dense": {"tokens": 8, "heads": "group", "block_n": 128, "num_warps": 8, "num_stages": 3},
    "sparse": {"tokens": None, "heads": "group", "block_n": 64, "num_warps": 4, "num_stages": 3},
}


def sparse_tokens(num_blocks: int, topk: int) -> int:
    """Tokens per sparse program. Where a request has few blocks beyond its top-k, the tokens of a tile select
    nearly the same blocks and sharing each K/V tile among 4-8 of them pays; where it has many (random-looking
    selections of 16 in hundreds of blocks) the union grows with every token and one token per program (M = the
    group's 16 heads) reads the least (H200: 4 best at 64 blocks, 1 at 256)."""
    ratio = num_blocks / max(topk, 1)
    return 8 if ratio <= 1 else 4 if ratio <= 6 else 2 if ratio <= 12 else 1


def _launch_options(kind: str, group: int, override: dict | None) -> dict:
    opts = dict(PREFILL_LAUNCH[kind])
    opts.update(override or {})
    heads = opts["heads"]
    opts["heads"] = group if heads == "group" or kind == "sparse" else min(int(heads), group)
    if group % opts["heads"]:
        raise ValueError(f"prefill attention: heads per program {opts['heads']} must divide the group {group}")
    return opts


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, positions: torch.Tensor, scale: float,
                      block_ids: torch.Tensor | None = None, *, num_requests: int, max_len: int,
                      out: torch.Tensor | None = None, launch: dict | None = None) -> torch.Tensor:
    """Triton prefill attention for the rows of requests [0, num_requests) -> [rows, Hq, D] in q's dtype.

    q [N, Hq, D] (rows query_start_loc[0] .. query_start_loc[num_requests] are read); k/v_cache [P, ps, Hkv, D];
    page_tables [>= num_requests, max_pages] int32; query_start_loc [>= num_requests + 1] int32 (device);
    positions [N]; block_ids None (dense) or [N, Hkv, topk] int32 ascending with a -1 tail; max_len: the longest
    request's row count (host int, sizes the grid). `out` may be a view; `launch` overrides PREFILL_LAUNCH.
    No host syncs.
    """
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if num_requests == 0 or max_len == 0:
        return out
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_tables", page_tables)):
        if x.stride(-1) != 1:
            raise ValueError(f"prefill attention: {name} needs a unit stride on its last dim, got {x.stride()}")
    if d & (d - 1) or ps & (ps - 1) or d < 16 or ps < 16:
        raise ValueError(f"prefill attention: head_dim {d} and page_size {ps} must be powers of two >= 16")
    if query_start_loc.dtype != torch.int32 or query_start_loc.numel() < num_requests + 1:
        raise ValueError("prefill attention: query_start_loc must be int32 [>= num_requests + 1]")
    group = hq // hkv
    sparse = block_ids is not None
    if sparse and (block_ids.dtype != torch.int32 or block_ids.stride(-1) != 1):
        raise ValueError("prefill attention: block_ids must be int32 with a unit last stride")
    opts = _launch_options("sparse" if sparse else "dense", group, launch)
    bt, hg = opts.pop("tokens"), opts.pop("heads")
    if bt is None:
        bt = sparse_tokens(page_tables.shape[1], block_ids.shape[-1])
    if bt & (bt - 1) or hg & (hg - 1):
        raise ValueError(f"prefill attention: tokens {bt} and heads {hg} per program must be powers of two")
    bt = max(bt, 16 // hg)  # tl.dot needs >= 16 rows (small groups of test models)
    block_n = min(opts.pop("block_n"), ps)
    dot_fp32 = torch.float32 in (q.dtype, k_cache.dtype)
    if dot_fp32 and launch is None:
        # fp32 (parity runs): twice the bytes per tile; the bf16 defaults would ask ~272 KB of shared memory
        block_n, opts["num_stages"] = min(block_n, 64), min(opts["num_stages"], 2)
    topk = block_ids.shape[-1] if sparse else 1
    bid = block_ids if sparse else page_tables
    bid_st = (block_ids.stride(0), block_ids.stride(1)) if sparse else (0, 0)
    num_tiles = -(-max_len // bt)
    runnable(_prefill_attn_kernel, q.device)[(num_tiles, num_requests, hkv * (group // hg))](
        q, k_cache, v_cache, page_tables, query_start_loc, positions, bid, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_tables.stride(0),
        bid_st[0], bid_st[1], out.stride(0), out.stride(1), float(scale) * _LOG2E, num_tiles,
        G=group, HG=hg, BT=bt, D=d, PS=ps, BLOCK_N=block_n, TOPK=topk, BLOCK_TOPK=max(2, next_pow2(topk)),
        SPARSE=sparse, DOT_FP32=dot_fp32, **opts)
    return out


__all__ = ["prefill_attention", "PREFILL_LAUNCH", "sparse_tokens"]
