"""Paged KV cache writes and whole-page gather/scatter.

Cache layouts (one tensor per layer):
  k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
  index_k_cache:    [num_pages, page_size, index_head_dim]   (sparse layers only; one index-K head)
A token's slot is `page_id * page_size + offset`; a slot < 0 marks a padding token that is not written.

`write_kv` is one Triton launch per layer for K, V and index-K together (the seed measured ~12 small torch
kernels per sparse layer for the same work); it derives (page, offset) from the slot in registers and casts to
the cache dtype on the store (bf16, fp16, fp32 or fp8). `gather_pages`/`scatter_pages` move whole pages between
a cache and a contiguous staging buffer (the KV transfer path).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, runnable, step_jit, use_triton


@step_jit(ptrs=("slot_ptr",))
def _write_kv_kernel(k_ptr, v_ptr, ik_ptr, slot_ptr, kc_ptr, vc_ptr, ikc_ptr,
                     k_st_t, k_st_h, v_st_t, v_st_h, ik_st_t,
                     kc_st_p, kc_st_o, kc_st_h, vc_st_p, vc_st_o, vc_st_h, ikc_st_p, ikc_st_o,
                     page_size,
                     H: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
                     HAS_INDEX: tl.constexpr):
    # one program per new token: its K and V rows [H, D] and its index-K row [DI]
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // page_size
        off = slot % page_size
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < H)[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + t * k_st_t + h[:, None] * k_st_h + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * v_st_t + h[:, None] * v_st_h + d[None, :], mask=mask)
        tl.store(kc_ptr + page * kc_st_p + off * kc_st_o + h[:, None] * kc_st_h + d[None, :],
                 k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + page * vc_st_p + off * vc_st_o + h[:, None] * vc_st_h + d[None, :],
                 v.to(vc_ptr.dtype.element_ty), mask=mask)
        if HAS_INDEX:
            di = tl.arange(0, BLOCK_DI)
            ik = tl.load(ik_ptr + t * ik_st_t + di, mask=di < DI)
            tl.store(ikc_ptr + page * ikc_st_p + off * ikc_st_o + di, ik.to(ikc_ptr.dtype.element_ty),
                     mask=di < DI)


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, page_ids_ptr, page_elems, src_page_stride, dst_page_stride,
                       GATHER: tl.constexpr, BLOCK: tl.constexpr):
    # program (i, c): chunk c of the i-th listed page; GATHER reads cache[page_ids[i]] into buf[i], else the reverse
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    if GATHER:
        src = src_ptr + page * src_page_stride + offs
        dst = dst_ptr + i * dst_page_stride + offs
    else:
        src = src_ptr + i * src_page_stride + offs
        dst = dst_ptr + page * dst_page_stride + offs
    x = tl.load(src, mask=mask)
    tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


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
             k_cache: torch.Tensor, v_cache: torch.Tensor, index_k_cache: torch.Tensor | None, *,
             backend: str | None = None) -> None:
    """Public launcher: checks shapes, then writes K, V (and index-K) in one Triton launch.

    backend None: Triton on CUDA tensors, the torch reference on others; "triton"/"ref" force one (Triton on CPU
    tensors runs in the interpreter). No host sync: safe inside CUDA-graph capture.
    """
    _check_write(k, v, index_k, slot_mapping, k_cache, v_cache, index_k_cache)
    if not use_triton(k.device, backend):
        write_kv_ref(k, v, index_k, slot_mapping, k_cache, v_cache, index_k_cache)
        return
    t, h, d = k.shape
    if t == 0:
        return
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"write_kv: {name} needs a unit stride on head_dim, got strides {x.stride()}")
    has_index = index_k is not None
    if has_index and (index_k.stride(-1) != 1 or index_k_cache.stride(-1) != 1):
        raise ValueError("write_kv: index_k and index_k_cache need a unit stride on their last dim")
    ik, ikc = (index_k, index_k_cache) if has_index else (k, k_cache)  # unused placeholders when absent
    di = index_k.shape[-1] if has_index else 1
    runnable(_write_kv_kernel, k.device)[(t,)](
        k, v, ik, slot_mapping, k_cache, v_cache, ikc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), ik.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ikc.stride(0), ikc.stride(1),
        k_cache.shape[1],
        H=h, D=d, DI=di, BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d), BLOCK_DI=next_pow2(di),
        HAS_INDEX=has_index, num_warps=4)


def gather_pages_ref(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole pages `cache[page_ids]` into one contiguous buffer [n, page_size, ...]."""
    return cache.index_select(0, page_ids.to(torch.long))


def scatter_pages_ref(cache: torch.Tensor, page_ids: torch.Tensor, data: torch.Tensor) -> None:
    """Write a contiguous buffer [n, page_size, ...] into pages `page_ids` of `cache`."""
    cache.index_copy_(0, page_ids.to(torch.long), data.to(cache.dtype))


_COPY_BLOCK = 4096


def _page_copy_ok(cache: torch.Tensor) -> bool:
    # the Triton copy walks one page as a flat run of elements
    return cache[0].is_contiguous() if cache.shape[0] else True


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """cache [P, page_size, ...], page_ids [n] int -> a new contiguous [n, page_size, ...] of the cache's dtype."""
    if page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gather_pages: page_ids must be int [n], got {page_ids.dtype} {tuple(page_ids.shape)}")
    if not use_triton(cache.device, backend) or not _page_copy_ok(cache):
        return gather_pages_ref(cache, page_ids)
    n = page_ids.numel()
    out = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    page_elems = cache[0].numel() if cache.shape[0] else 0
    if n and page_elems:
        grid = (n, triton.cdiv(page_elems, _COPY_BLOCK))
        runnable(_copy_pages_kernel, cache.device)[grid](cache, out, page_ids, page_elems, cache.stride(0),
                                                          page_elems, GATHER=True, BLOCK=_COPY_BLOCK)
    return out


def scatter_pages(cache: torch.Tensor, page_ids: torch.Tensor, data: torch.Tensor, *,
                  backend: str | None = None) -> None:
    """Write data [n, page_size, ...] into pages `page_ids` of `cache` (cast to the cache dtype)."""
    if data.shape[1:] != cache.shape[1:] or data.shape[0] != page_ids.numel():
        raise ValueError(f"scatter_pages: data {tuple(data.shape)} does not fit {page_ids.numel()} pages of "
                         f"{tuple(cache.shape[1:])}")
    if page_ids.dim() != 1 or page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"scatter_pages: page_ids must be int [n], got {page_ids.dtype} {tuple(page_ids.shape)}")
    if not use_triton(cache.device, backend) or not _page_copy_ok(cache) or not data.is_contiguous():
        scatter_pages_ref(cache, page_ids, data)
        return
    n = page_ids.numel()
    page_elems = cache[0].numel() if cache.shape[0] else 0
    if n and page_elems:
        grid = (n, triton.cdiv(page_elems, _COPY_BLOCK))
        runnable(_copy_pages_kernel, cache.device)[grid](data, cache, page_ids, page_elems, page_elems,
                                                          cache.stride(0), GATHER=False, BLOCK=_COPY_BLOCK)


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
    if index_k_cache is not None and index_k_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"write_kv: index_k_cache {tuple(index_k_cache.shape)} must share pages with the K cache")
    devices = {x.device for x in (k, v, slot_mapping, k_cache, v_cache) if x is not None}
    if len(devices) != 1:
        raise ValueError(f"write_kv: tensors on several devices {devices}")
