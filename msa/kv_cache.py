"""The paged KV cache of one shard: per layer K and V pages, plus index-K pages on sparse layers.

Layouts (kernels/paged_kv.py fixes them):
  k[layer], v[layer]: [num_pages, page_size, kv_heads_local, head_dim]
  index_k[layer]:     [num_pages, page_size, index_head_dim] on sparse layers (one head, replicated on every tp
                      rank), None on dense layers.
Page p of every layer belongs to the same request: one page id addresses both page families.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from msa.config import M3Config
from msa.parallel import ParallelContext


def _local_kv_heads(config: M3Config, ctx: ParallelContext | None) -> int:
    return (ctx or ParallelContext.single()).kv_head_range(config.num_key_value_heads)[1]


@dataclass
class KVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    index_k: list[torch.Tensor | None]
    num_pages: int
    page_size: int

    @classmethod
    def allocate(cls, config: M3Config, num_pages: int, *, device="cpu", dtype=torch.float32,
                 ctx: ParallelContext | None = None) -> KVCache:
        """Zero-filled pages for every layer of `config` as sharded by `ctx`."""
        ps, hkv = config.page_size, _local_kv_heads(config, ctx)
        k, v, idx = [], [], []
        for layer in range(config.num_hidden_layers):
            k.append(torch.zeros(num_pages, ps, hkv, config.head_dim, dtype=dtype, device=device))
            v.append(torch.zeros(num_pages, ps, hkv, config.head_dim, dtype=dtype, device=device))
            idx.append(torch.zeros(num_pages, ps, config.index_head_dim, dtype=dtype, device=device)
                       if config.is_sparse(layer) else None)
        return cls(k=k, v=v, index_k=idx, num_pages=num_pages, page_size=ps)

    @staticmethod
    def bytes_per_page(config: M3Config, dtype=torch.float32, ctx: ParallelContext | None = None) -> int:
        """Bytes one page occupies on this shard, summed over all layers and both page families."""
        hkv = _local_kv_heads(config, ctx)
        elems = config.num_hidden_layers * 2 * hkv * config.head_dim + len(config.sparse_layers) * config.index_head_dim
        return config.page_size * elems * torch.empty((), dtype=dtype).element_size()

    @property
    def num_layers(self) -> int:
        return len(self.k)


__all__ = ["KVCache"]
