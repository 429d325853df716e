"""The MSA lightning indexer: scores key blocks per query token and selects the top-k blocks per KV group.

Its q heads (one per KV group) shard with the KV heads; its single K head is replicated on every tp rank and
stored in the index-K cache, which shares page ids with the main K/V cache.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.index_topk import index_topk
from kernels.rope import qk_norm_rope
from msa.config import M3Config
from msa.layers import RMSNorm
from msa.linear import KVHeadParallelLinear, ReplicatedLinear
from msa.metadata import AttentionMetadata
from msa.parallel import ParallelContext


class Indexer(nn.Module):
    def __init__(self, config: M3Config, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        d, eps = config.index_head_dim, config.rms_norm_eps
        self.q_proj = KVHeadParallelLinear(config.hidden_size, d, config.index_n_heads, ctx, dtype=dtype,
                                           device=device)
        self.k_proj = ReplicatedLinear(config.hidden_size, d, dtype=dtype, device=device)
        self.q_norm = RMSNorm(d, eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(d, eps, dtype=dtype, device=device)
        self.head_dim = d
        self.topk = config.index_topk_blocks
        self.local_blocks = config.index_local_blocks

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] (the attention input) -> index q [T, Hi_local, Di], index k [T, Di]; both normed (own weights)
        and rotated with the same partial RoPE as the main q/k."""
        q = self.q_proj(h).view(h.shape[0], self.q_proj.num_heads, self.head_dim)
        return (qk_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin),
                qk_norm_rope(self.k_proj(h), self.k_norm.weight, self.k_norm.eps, cos, sin))

    def select(self, q_idx: torch.Tensor, index_k_cache: torch.Tensor, meta: AttentionMetadata, *,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block top-k over the paged index-K cache (this step's index-K must be written already).
        -> (int32 [T, Hi_local, topk]: ascending logical block ids, -1 tail padding; their pages beside them for
        the decode rows on the Triton path, else None: the decode attention kernel skips the table lookup)."""
        return index_topk(q_idx, index_k_cache, meta.page_tables, meta.row_seq, meta.positions, self.topk,
                          self.local_blocks, num_prefill_rows=meta.num_prefill_tokens, backend=backend,
                          prefill=meta.prefill, with_pages=True)


__all__ = ["Indexer"]
