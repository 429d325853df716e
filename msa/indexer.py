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

# Whether the selection also writes the chosen blocks' pages for the decode attention kernel (`page_ids`, saving
# it a table read per block). Off: H200, bench_decode.py's method (docs/benchmarks.md K1), the pages cost the
# indexer more than they save the attention at every shape: B = 1 / 16 / 64 at 8.7k index +0.2 / +0.2 / +1.6 us,
# attention -0.3 / -0.2 / -0.9; at 131k the rounds selection's page gather +3.8 / +3.0 us.
WRITE_PAGES = False


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
        -> (int32 [T, Hi_local, topk]: ascending logical block ids, -1 tail padding; with WRITE_PAGES their pages
        beside them for the decode rows on the Triton path, else None: the decode attention kernel looks them up)."""
        picked = index_topk(q_idx, index_k_cache, meta.page_tables, meta.row_seq, meta.positions, self.topk,
                            self.local_blocks, num_prefill_rows=meta.num_prefill_tokens, backend=backend,
                            prefill=meta.prefill, with_pages=WRITE_PAGES)
        return picked if WRITE_PAGES else (picked, None)


__all__ = ["Indexer", "WRITE_PAGES"]
