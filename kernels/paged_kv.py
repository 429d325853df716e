"""Paged KV cache writes and whole-page gather/scatter.

Cache layouts (one tensor per layer):
  k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
  index_k_cache:    [num_pages, page_size, index_head_dim]   (sparse layers only; one index-K head)
A token's slot is `page_id * page_size + offset`; a slot < 0 marks a padding token that is not written.
"""
from __future__ import annotations

import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None, slot_mapping: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, index_k_cache: torch.Tensor | None) -> None:
    """Write this step's K/V [T, Hkv, D] and index-K [T, Di] into their slots, casting to the cache dtype."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
    if index_k is not None:
        index_k_cache.view(-1, index_k_cache.shape[-1])[slots] = index_k[keep].to(index_k_cache.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None, slot_mapping: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, index_k_cache: torch.Tensor | None) -> None:
    """Public launcher: checks shapes, then writes (torch reference until the Triton kernel lands)."""
    _check_write(k, v, index_k, slot_mapping, k_cache, v_cache, index_k_cache)
    write_kv_ref(k, v, index_k, slot_mapping, k_cache, v_cache, index_k_cache)


def gather_pages_ref(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole pages `cache[page_ids]` into one contiguous buffer [n, page_size, ...]."""
    return cache.index_select(0, page_ids.to(torch.long))


def scatter_pages_ref(cache: torch.Tensor, page_ids: torch.Tensor, data: torch.Tensor) -> None:
    """Write a contiguous buffer [n, page_size, ...] into pages `page_ids` of `cache`."""
    cache.index_copy_(0, page_ids.to(torch.long), data.to(cache.dtype))


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    return gather_pages_ref(cache, page_ids)


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, data: torch.Tensor) -> None:
    if data.shape[1:] != cache.shape[1:] or data.shape[0] != page_ids.numel():
        raise ValueError(f"scatter_pages: data {tuple(data.shape)} does not fit {page_ids.numel()} pages of "
                         f"{tuple(cache.shape[1:])}")
    scatter_pages_ref(cache, page_ids, data)


def _check_write(k, v, index_k, slot_mapping, k_cache, v_cache, index_k_cache) -> None:
    t = k.shape[0]
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"write_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, Hkv, D]")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"write_kv: caches {tuple(k_cache.shape)} do not hold [.., .., {k.shape[1]}, {k.shape[2]}]")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be int [T={t}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if (index_k is None) != (index_k_cache is None):
        raise ValueError("write_kv: index_k and index_k_cache must be given together")
    if index_k is not None and (index_k.shape != (t, index_k_cache.shape[-1])):
        raise ValueError(f"write_kv: index_k {tuple(index_k.shape)} must be [T, {index_k_cache.shape[-1]}]")
