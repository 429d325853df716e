"""M3 attention over the paged cache: dense causal (full_attention layers) or MSA block-sparse.

Per step: q, k, v = h W; per-head Gemma RMSNorm of q and k (before RoPE); partial RoPE; K, V (and the indexer's
index-K on sparse layers) written to their slots in one launch; then attention reads the cache. Sparse layers
attend only to the blocks the indexer selected for the query's KV group, with a token-level causal mask.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention import dense_attention, sparse_attention
from kernels.paged_kv import write_kv
from kernels.rope import qk_norm_rope
from msa.config import M3Config
from msa.indexer import Indexer
from msa.kv_cache import KVCache
from msa.layers import RMSNorm
from msa.linear import QKVParallelLinear, RowParallelLinear
from msa.metadata import AttentionMetadata
from msa.parallel import ParallelContext


class M3Attention(nn.Module):
    def __init__(self, config: M3Config, layer_idx: int, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        self.layer_idx = layer_idx
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, ctx, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, ctx, dtype=dtype,
                                        device=device)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.indexer = Indexer(config, ctx, dtype=dtype, device=device) if config.is_sparse(layer_idx) else None
        self.scale = d ** -0.5
        # None: the Triton kernels on CUDA, the CPU serving path elsewhere (decode rows batched in torch, prompt
        # rows by the references: kernels/attention.py); "triton" / "ref" force one (the
        # engine's `attention_backend`; tests force Triton on CPU through the interpreter)
        self.backend: str | None = None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """h [T, H] (normed layer input) -> attention output [T, H] (after o_proj, reduced over tp)."""
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(h))
        q = qk_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = qk_norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin)
        layer = self.layer_idx
        k_cache, v_cache, idx_cache = kv.k[layer], kv.v[layer], kv.index_k[layer]
        q_idx = idx_k = None
        if self.indexer is not None:
            q_idx, idx_k = self.indexer.project(h, cos, sin)
        write_kv(k, v, idx_k, meta.slot_mapping, k_cache, v_cache, idx_cache)
        if self.indexer is None:
            out = dense_attention(q, k_cache, v_cache, meta.page_tables, meta.row_seq, meta.positions, self.scale,
                                  num_prefill_rows=meta.num_prefill_tokens, backend=self.backend,
                                  prefill=meta.prefill)
        else:
            block_ids, page_ids = self.indexer.select(q_idx, idx_cache, meta, backend=self.backend)
            out = sparse_attention(q, k_cache, v_cache, meta.page_tables, meta.row_seq, meta.positions, block_ids,
                                   self.scale, num_prefill_rows=meta.num_prefill_tokens, backend=self.backend,
                                   prefill=meta.prefill, page_ids=page_ids)
        return self.o_proj(out.flatten(1))


__all__ = ["M3Attention"]
