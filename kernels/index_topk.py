"""MSA lightning-indexer block scores and top-k block selection over the paged index-K cache.

Semantics (M3_SPEC.md §3, one row = one query token at absolute position p of its request):
  score(r, b) = max over keys j in block b with j <= p of <q_idx[r], index_k[j]>   (fp32, no scale)
  the local blocks b >= p // bs - local_blocks + 1 are forced in (score +inf);
  the top min(topk, p // bs + 1) blocks are selected per index head r.
Output layout (the one explicit top-k layout of the project): int32 [N, n_idx, topk], the selected *logical*
block ids of the request in ascending order, -1 padding at the tail. Ties in score go to the lower block id.
"""
from __future__ import annotations

import torch

from kernels._paged import gather_context, request_rows


def index_topk_ref(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor,
                   row_seq: torch.Tensor, positions: torch.Tensor, topk: int, local_blocks: int) -> torch.Tensor:
    """q_idx [N, Hi, Di]; index_k_cache [P, ps, Di]; page_tables [R, max_pages]; row_seq [N]; positions [N]."""
    n, hi, _ = q_idx.shape
    ps = index_k_cache.shape[1]
    out = torch.full((n, hi, topk), -1, dtype=torch.int32, device=q_idx.device)
    for r, rows in request_rows(row_seq):
        pos = positions[rows].to(torch.long)
        ctx = int(pos.max()) + 1
        keys = gather_context(index_k_cache, page_tables[r], ctx).float()  # [L, Di]
        scores = torch.einsum("nhd,ld->nhl", q_idx[rows].float(), keys)
        future = torch.arange(ctx, device=keys.device)[None, :] > pos[:, None]  # [n, L]
        scores = scores.masked_fill(future[:, None, :], float("-inf"))
        nb = -(-ctx // ps)
        scores = torch.nn.functional.pad(scores, (0, nb * ps - ctx), value=float("-inf"))
        block_scores = scores.view(len(rows), hi, nb, ps).amax(-1)  # [n, Hi, nb]
        own = pos // ps
        blocks = torch.arange(nb, device=keys.device)
        local = (blocks[None, :] >= (own - local_blocks + 1)[:, None]) & (blocks[None, :] <= own[:, None])
        block_scores = block_scores.masked_fill(local[:, None, :], float("inf"))
        out[rows] = select_topk_blocks(block_scores, topk)
    return out


def select_topk_blocks(block_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., nb] fp32 scores (-inf = not visible) -> [..., topk] int32 ascending block ids, -1 tail padding."""
    nb = block_scores.shape[-1]
    # stable descending sort keeps the lower block id first among equal scores
    order = torch.sort(block_scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    chosen = torch.gather(block_scores, -1, order)
    ids = torch.where(chosen == float("-inf"), torch.full_like(order, nb), order)
    ids = torch.sort(ids, dim=-1).values
    ids = torch.where(ids == nb, torch.full_like(ids, -1), ids).to(torch.int32)
    if ids.shape[-1] < topk:
        pad = torch.full((*ids.shape[:-1], topk - ids.shape[-1]), -1, dtype=torch.int32, device=ids.device)
        ids = torch.cat([ids, pad], dim=-1)
    return ids


def index_topk(q_idx: torch.Tensor, index_k_cache: torch.Tensor, page_tables: torch.Tensor, row_seq: torch.Tensor,
               positions: torch.Tensor, topk: int, local_blocks: int, *, num_prefill_rows: int = 0) -> torch.Tensor:
    """Public launcher (torch reference until the Triton kernel lands). Rows [num_prefill_rows, N) are decode
    rows (the batch suffix) and may take a dedicated decode kernel."""
    if q_idx.dim() != 3 or index_k_cache.dim() != 3 or q_idx.shape[-1] != index_k_cache.shape[-1]:
        raise ValueError(f"index_topk: q_idx {tuple(q_idx.shape)} / index_k_cache {tuple(index_k_cache.shape)}")
    if row_seq.shape != positions.shape or row_seq.shape[0] != q_idx.shape[0]:
        raise ValueError("index_topk: row_seq and positions must be [N] with N = q_idx.shape[0]")
    return index_topk_ref(q_idx, index_k_cache, page_tables, row_seq, positions, topk, local_blocks)
