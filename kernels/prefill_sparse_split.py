"""Block-major MSA sparse prefill attention: each selected K/V block is read once for all the tokens that chose it.

`prefill_attention`'s sparse path (kernels/prefill_attention.py) is token-major: a program holds one token (or a
few) and gathers its top-k blocks, so a block chosen by many tokens is read once per token (or per token tile).
With selections that differ from token to token that traffic is the whole cost: 64 KB of K/V per (token, KV
group, selected block), bound by L2 bandwidth (docs/benchmarks.md, "Prefill"). Here the loop is turned around:

1. Pairs. Every (row, KV head, slot) of `block_ids` [N, Hkv, K] names one block of one request; its key
   (kv head, request, block) orders the pairs (one stable device sort), so the pairs of a block are contiguous.
2. Split: a program takes up to W consecutive pairs of one block (one K/V block, W tokens x the group's G query
   heads = W * G rows) and computes each row's softmax over that block's visible keys (token-level causal mask):
   a partial output, normalised, with its running max and sum, stored per (pair, head).
3. Merge: a program per (row, KV head) combines its K partials with the usual log-sum-exp weights.

Bytes per (token, group, block): the K/V block shared by W tokens (64 KB / W), the token's query heads (4 KB), a
partial written and read back (4 KB each in bf16, plus 8 bytes of stats per head). Partials are kept in q's dtype:
each is a convex combination of V rows, so bf16 loses no more than the output's own rounding does.
No host sync: the work list is built on the device, and programs past its end return at once. The torch
reference is `paged_attention_ref` (kernels/attention.py) with `block_ids`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import runnable
from kernels.prefill_attention import _tile_step

_LOG2E = 1.4426950408889634

# Pairs per split program (W; W * G rows share a K/V block), keys per tile, warps, stages.
SPLIT_LAUNCH = {"pairs": 4, "block_n": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _split_kernel(q_ptr, kc_ptr, vc_ptr, pt_ptr, pos_ptr, key_ptr, perm_ptr, item_ptr, po_ptr, pm_ptr, pl_ptr,
                  q_st_n, q_st_h, kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, pt_st_r,
                  num_pairs, keys_per_head, max_pages, qk_scale_log2,
                  G: tl.constexpr, W: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr,
                  HKV: tl.constexpr, TOPK: tl.constexpr, DOT_FP32: tl.constexpr):
    i0 = tl.load(item_ptr + tl.program_id(0))
    if i0 < 0:  # past the end of the work list
        return
    key0 = tl.load(key_ptr + i0)
    kvh = key0 // keys_per_head
    req = (key0 % keys_per_head) // max_pages
    blk = key0 % max_pages
    BM: tl.constexpr = W * G
    m = tl.arange(0, BM)
    idx = i0 + m // G  # row m: pair idx (sorted position), query head m % G of the KV group
    inb = idx < num_pairs
    ok = (tl.load(key_ptr + idx, mask=inb, other=-1) == key0) & inb
    pair = tl.load(perm_ptr + idx, mask=ok, other=0)
    row = pair // (HKV * TOPK)
    heads = kvh * G + m % G
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr + row, mask=ok, other=-1).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * q_st_n + heads[:, None] * q_st_h + d[None, :], mask=ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    page = tl.load(pt_ptr + req * pt_st_r + blk).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for s in range(0, PS // BLOCK_N):
        off = s * BLOCK_N + n
        m_i, l_i, acc = _tile_step(q, kc_ptr + page * kc_st_p + off[:, None] * kc_st_o + kvh * kc_st_h + d[None, :],
                                   vc_ptr + page * vc_st_p + off[:, None] * vc_st_o + kvh * vc_st_h + d[None, :],
                                   blk * PS + off, pos, ok, m_i, l_i, acc, qk_scale_log2, DOT_FP32, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    prow = pair * G + m % G  # partial (pair, head)
    tl.store(po_ptr + prow[:, None] * D + d[None, :], out.to(po_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(pm_ptr + prow, m_i, mask=ok)
    tl.store(pl_ptr + prow, l_i, mask=ok)


@triton.jit
def _merge_kernel(bid_ptr, po_ptr, pm_ptr, pl_ptr, o_ptr, bid_st_n, bid_st_h, o_st_n, o_st_h,
                  G: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, TOPK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    base = (row * HKV + kvh) * TOPK  # this (row, KV head)'s first pair
    m_all = tl.full([G], float("-inf"), tl.float32)
    for k in range(0, TOPK):
        valid = tl.load(bid_ptr + row * bid_st_n + kvh * bid_st_h + k) >= 0
        mk = tl.load(pm_ptr + (base + k) * G + g, mask=valid & (g < G), other=float("-inf"))
        m_all = tl.maximum(m_all, mk)
    m_use = tl.where(m_all > float("-inf"), m_all, 0.0)
    den = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    for k in range(0, TOPK):
        valid = tl.load(bid_ptr + row * bid_st_n + kvh * bid_st_h + k) >= 0
        vg = valid & (g < G)
        w = tl.load(pl_ptr + (base + k) * G + g, mask=vg, other=0.0) * \
            tl.exp2(tl.load(pm_ptr + (base + k) * G + g, mask=vg, other=float("-inf")) - m_use)
        part = tl.load(po_ptr + ((base + k) * G + g)[:, None] * D + d[None, :], mask=vg[:, None], other=0.0)
        den += w
        acc += w[:, None] * part.to(tl.float32)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(o_ptr + row * o_st_n + (kvh * G + g)[:, None] * o_st_h + d[None, :], out.to(o_ptr.dtype.element_ty))


def work_list(block_ids: torch.Tensor, row_seq: torch.Tensor, max_pages: int, num_requests: int,
              pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_ids [N, Hkv, K] (-1: no block), row_seq [N] (request of each row) -> (sorted keys [P] int64,
    perm [P] int64: the pair index at each sorted position, items [>= programs] int64: each program's first
    sorted position or -1). A program takes up to `pairs` consecutive pairs of one (kv head, request, block).
    Device ops only; the list is sized by a host bound, not by its content."""
    n, hkv, topk = block_ids.shape
    keys_per_head = num_requests * max_pages
    none = hkv * keys_per_head  # sorts after every real key
    bid = block_ids.long()
    heads = torch.arange(hkv, device=bid.device).view(1, hkv, 1)
    key = heads * keys_per_head + row_seq[:n].long().view(n, 1, 1) * max_pages + bid
    key = torch.where(bid >= 0, key, none).reshape(-1)
    keys, perm = torch.sort(key, stable=True)
    p = keys.numel()
    i = torch.arange(p, device=keys.device)
    starts = torch.ones(p, dtype=torch.bool, device=keys.device)
    starts[1:] = keys[1:] != keys[:-1]
    seg_first = torch.where(starts, i, 0).cummax(0).values
    first_of_item = ((i - seg_first) % pairs == 0) & (keys < none)
    bound = num_programs(p, pairs, hkv * keys_per_head)
    items = torch.full((bound + 1,), -1, dtype=torch.int64, device=keys.device)
    rank = torch.where(first_of_item, first_of_item.cumsum(0) - 1, bound)  # non-firsts land in the spare slot
    items.scatter_(0, rank, i)
    items[bound] = -1
    return keys, perm, items


def num_programs(num_pairs: int, pairs: int, num_keys: int) -> int:
    """Upper bound of split programs: each segment (one block's pairs) adds at most one partial program."""
    return -(-num_pairs // pairs) + min(num_pairs, num_keys)


def prefill_sparse_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_tables: torch.Tensor,
                         row_seq: torch.Tensor, positions: torch.Tensor, block_ids: torch.Tensor, scale: float, *,
                         num_requests: int, out: torch.Tensor | None = None,
                         launch: dict | None = None) -> torch.Tensor:
    """Block-sparse prefill attention of rows [0, N) -> [N, Hq, D] in q's dtype (see the module docstring).

    q [N, Hq, D]; k/v_cache [P, ps, Hkv, D]; page_tables [>= num_requests, max_pages]; row_seq [N] (request of each
    row, < num_requests); positions [N]; block_ids [N, Hkv, K] int32, -1 where a row selected fewer blocks (any
    order). `launch` overrides SPLIT_LAUNCH. No host syncs. Workspace: N * Hkv * K partials of G x D in q's dtype."""
    n, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("page_tables", page_tables),
                    ("block_ids", block_ids)):
        if x.stride(-1) != 1:
            raise ValueError(f"sparse split: {name} needs a unit stride on its last dim, got {x.stride()}")
    if d & (d - 1) or ps & (ps - 1) or d < 16 or ps < 16:
        raise ValueError(f"sparse split: head_dim {d} and page_size {ps} must be powers of two >= 16")
    group = hq // hkv
    if group & (group - 1):
        raise ValueError(f"sparse split: {group} query heads per KV head must be a power of two")
    opts = dict(SPLIT_LAUNCH)
    opts.update(launch or {})
    pairs = max(int(opts.pop("pairs")), -(-16 // group))  # tl.dot needs >= 16 rows
    block_n = min(int(opts.pop("block_n")), ps)
    dot_fp32 = torch.float32 in (q.dtype, k_cache.dtype)
    topk = block_ids.shape[-1]
    max_pages = page_tables.shape[1]
    keys, perm, items = work_list(block_ids, row_seq, max_pages, num_requests, pairs)
    num_pairs = keys.numel()
    part_o = torch.empty((num_pairs * group, d), dtype=q.dtype, device=q.device)
    part_m = torch.empty((num_pairs * group,), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    runnable(_split_kernel, q.device)[(items.numel() - 1,)](
        q, k_cache, v_cache, page_tables, positions, keys, perm, items, part_o, part_m, part_l,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_tables.stride(0),
        num_pairs, num_requests * max_pages, max_pages, float(scale) * _LOG2E,
        G=group, W=pairs, D=d, PS=ps, BLOCK_N=block_n, HKV=hkv, TOPK=topk, DOT_FP32=dot_fp32, **opts)
    runnable(_merge_kernel, q.device)[(n, hkv)](
        block_ids, part_o, part_m, part_l, out, block_ids.stride(0), block_ids.stride(1), out.stride(0),
        out.stride(1), G=group, D=d, HKV=hkv, TOPK=topk)
    return out


__all__ = ["SPLIT_LAUNCH", "prefill_sparse_split", "work_list", "num_programs"]
