"""Per-head Gemma RMSNorm + partial NeoX RoPE of q / k (and the indexer's), one launch: the attention producer.

M3 norms q and k per head (one weight vector [D] for all heads) BEFORE RoPE, and rotates only the first
`rotary_dim` dims (NeoX half split inside them). The reference is the model's own two steps, rounded the way it
rounds: norm in fp32 and cast to x's dtype, then RoPE in fp32 on the rotated part and cast back (so bf16 results
equal the unfused path's up to the last bit of the fp32 sums' order). Unfused on an 8k-token prefill, the norm
and RoPE of q alone made ~10 passes over a [T, 64, 128] fp32 tensor per layer.

Kernel: program (token, block of heads) holds [HB, D]; each element's rotation partner (d +- rotary_dim / 2) is
loaded beside it (a second read of the same row, from L1), so nothing is shuffled in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, runnable, use_triton
from kernels.rms_norm import rms_norm_ref


def qk_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] or [T, D]; weight [D]; cos/sin [T, rotary_dim] fp32 -> [same shape] in x's dtype."""
    y = rms_norm_ref(x, weight, eps)
    rd = cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = y[..., :rd].float(), y[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([(rot * cos + rotated * sin).to(x.dtype), rest], dim=-1)


@triton.jit
def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, o_ptr, x_st_t, x_st_h, o_st_t, o_st_h, cs_st_t,
                         num_heads, eps, D: tl.constexpr, BD: tl.constexpr, RD: tl.constexpr, HB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, BD)
    ok = (h < num_heads)[:, None] & (d < D)[None, :]
    row = x_ptr + t * x_st_t + h[:, None] * x_st_h
    x = tl.load(row + d[None, :], mask=ok, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [HB]
    w1 = 1.0 + tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (xf * inv[:, None] * w1[None, :]).to(x.dtype).to(tl.float32)
    # the partner of d inside the rotated dims: d + RD/2 for the first half (negated), d - RD/2 for the second
    HALF: tl.constexpr = RD // 2
    in_rot = d < RD
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    partner = tl.where(in_rot, partner, d)
    xp = tl.load(row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    wp = 1.0 + tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
    yp = (xp * inv[:, None] * wp[None, :]).to(x.dtype).to(tl.float32)
    cos = tl.load(cos_ptr + t * cs_st_t + d, mask=in_rot, other=1.0)
    sin = tl.load(sin_ptr + t * cs_st_t + d, mask=in_rot, other=0.0)
    rotated = tl.where(d < HALF, -yp, yp)
    out = tl.where(in_rot[None, :], y * cos[None, :] + rotated * sin[None, :], y)
    tl.store(o_ptr + t * o_st_t + h[:, None] * o_st_h + d[None, :], out.to(o_ptr.dtype.element_ty), mask=ok)


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
                 backend: str | None = None) -> torch.Tensor:
    """Public launcher (shapes as in `qk_norm_rope_ref`) -> a new contiguous tensor in x's dtype. x may be a
    strided view (the q/k columns of a fused projection output): unit stride on its last dim only. backend None:
    Triton on CUDA tensors, the reference elsewhere; "triton" / "ref" force one. No host syncs."""
    if x.dim() not in (2, 3) or weight.shape != (x.shape[-1],) or cos.shape != sin.shape:
        raise ValueError(f"qk_norm_rope: x {tuple(x.shape)} must be [T, H, D] or [T, D], weight [D], cos = sin "
                         f"shapes, got weight {tuple(weight.shape)}, cos {tuple(cos.shape)}")
    t, d = x.shape[0], x.shape[-1]
    rd = cos.shape[-1]
    if cos.shape[0] != t or rd % 2 or rd > d:
        raise ValueError(f"qk_norm_rope: cos/sin {tuple(cos.shape)} must be [T={t}, rotary_dim <= {d}], even")
    if not use_triton(x.device, backend):
        return qk_norm_rope_ref(x, weight, eps, cos, sin)
    x3 = x if x.dim() == 3 else x[:, None, :]
    if x3.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qk_norm_rope: x, cos and sin need a unit stride on their last dim (cos, sin alike)")
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if t == 0:
        return out.view(x.shape)
    heads = x3.shape[1]
    hb = min(next_pow2(heads), max(1, 4096 // next_pow2(d)))
    runnable(_qk_norm_rope_kernel, x.device)[(t, triton.cdiv(heads, hb))](
        x3, weight, cos, sin, out, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), cos.stride(0), heads,
        float(eps), D=d, BD=next_pow2(d), RD=rd, HB=hb, num_warps=4)
    return out.view(x.shape)


__all__ = ["qk_norm_rope", "qk_norm_rope_ref"]
