"""Paged attention over any rows (prefill chunks and decode rows alike): dense causal and MSA block-sparse.

Each row is one query token at absolute position p of request `row_seq[row]`; it sees that request's keys
j <= p (token-level causal mask), read from the paged caches through `page_tables`. For sparse layers it sees
only keys in the blocks that its KV group selected (`block_ids` [N, Hkv, topk], ascending, -1 padded).
The current step's K/V must already be in the cache (write first, then attend).
"""
from __future__ import annotations

import torch

from kernels._paged import gather_context, request_rows


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


def dense_attention(q, k_cache, v_cache, page_tables, row_seq, positions, scale, *, num_prefill_rows=0):
    """Public launcher, dense causal (torch reference until the Triton kernels land).

    Rows [0, num_prefill_rows) are prefill-chunk tokens, rows [num_prefill_rows, N) decode rows (the batch
    suffix); a launcher may route the two spans to different kernels.
    """
    _check(q, k_cache, v_cache, row_seq, positions, None)
    return paged_attention_ref(q, k_cache, v_cache, page_tables, row_seq, positions, scale)


def sparse_attention(q, k_cache, v_cache, page_tables, row_seq, positions, block_ids, scale, *,
                     num_prefill_rows=0):
    """Public launcher, MSA block-sparse (torch reference until the Triton kernels land); spans as above."""
    _check(q, k_cache, v_cache, row_seq, positions, block_ids)
    return paged_attention_ref(q, k_cache, v_cache, page_tables, row_seq, positions, scale, block_ids)
