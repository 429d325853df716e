"""Gemma RMSNorm (+ the residual add before it), one launch: the hidden-state norms of every layer and the final norm.

y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32 and cast back to x's dtype; with a residual the sum
x + residual is taken first in the activation dtype (rounded there, like the model's `x + residual`) and both the
normed sum and the sum come back. Unfused, an 8k-token prefill of m3-slice spent ~15 ms of ~80 ms in the fp32
elementwise passes of this (pow, mean, mul, add and the bf16 <-> fp32 copies).

Kernel: program i holds ROWS rows [ROWS, BD] (BD = next_pow2(D)); one row of 6144 a program, 32 rows of 128. A row
of x is addressed as a * stride_a + b * stride_b for x viewed as [A, B, D] (B = the second-to-last dim), so the
q/k columns of a fused projection output ([T, H, D] with a row stride of the whole projection) are read in place.
Outputs are new contiguous tensors (or `out`, contiguous).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, runnable, step_jit, use_triton

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # elements a program holds for short rows (ROWS = _TILE // BD rows of BD)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None):
    """x [..., D]; weight [D] -> norm(x) [..., D] in x's dtype; with residual [..., D]: (norm(x + residual),
    x + residual), the sum in the activation dtype. `out`, when given, receives the normed result (and is returned).
    The model's own math (msa/layers.py before this kernel), step for step."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1.0 + weight.float())).to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y if residual is None else (y, x)


@step_jit(ints=("n_rows",))
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, n_rows, inner, x_st_a, x_st_b, r_st_a, r_st_b, eps,
                     D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BD)
    ok = (rows < n_rows)[:, None] & (d < D)[None, :]
    a = rows // inner
    b = rows % inner
    x = tl.load(x_ptr + (a * x_st_a + b * x_st_b)[:, None] + d[None, :], mask=ok, other=0.0)
    dst = rows[:, None] * D + d[None, :]  # outputs are contiguous [n_rows, D]
    if HAS_RES:
        r = tl.load(r_ptr + (a * r_st_a + b * r_st_b)[:, None] + d[None, :], mask=ok, other=0.0)
        # the sum rounded to the activation dtype (an fp32 add then one rounding equals torch's bf16/fp16 add)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + dst, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [ROWS]
    w1 = 1.0 + tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = xf * inv[:, None] * w1[None, :]
    tl.store(o_ptr + dst, y.to(o_ptr.dtype.element_ty), mask=ok)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as [A, B, D] (B = the second-to-last dim, 1 for 1-d/2-d), a view whenever torch can make one."""
    if t.dim() == 1:
        return t[None, None, :]
    if t.dim() == 2:
        return t[:, None, :]
    return t if t.dim() == 3 else t.flatten(0, -3)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, backend: str | None = None):
    """Public launcher: Gemma RMSNorm over the last dim of x [..., D] with weight [D].

    Returns norm(x) [..., D] in x's dtype; with residual (x's shape and dtype) returns (norm(x + residual),
    x + residual), like msa's RMSNorm. `out` (x's shape and dtype, contiguous) receives the normed result; the sum
    is always a new contiguous tensor. x and residual may be strided views with a unit stride on the last dim
    (e.g. [T, H, D] columns of a fused projection output). backend None: Triton on CUDA tensors, the reference
    elsewhere; "triton" / "ref" force one (Triton on CPU tensors runs in the interpreter). No host syncs: safe
    inside CUDA-graph capture (compile it outside the capture first).
    """
    d = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or weight.shape != (d,):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} must be [..., D] with weight [D], got weight "
                         f"{tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if out is not None and out.shape != x.shape:
        raise ValueError(f"rms_norm: out {tuple(out.shape)} must have x's shape {tuple(x.shape)}")
    if not use_triton(x.device, backend):
        return rms_norm_ref(x, weight, eps, residual=residual, out=out)
    _check_triton(x, weight, residual, out)
    normed = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    n_rows = x.numel() // d if d else 0
    if n_rows:
        x3 = _rows_view(x)
        r3 = _rows_view(residual) if residual is not None else x3
        if r3.stride(-1) != 1:  # a flatten that had to copy a strided residual keeps a unit stride; checked anyway
            raise ValueError("rms_norm: residual needs a unit stride on its last dim")
        bd = next_pow2(d)
        rows = max(1, _TILE // bd)
        rows = min(rows, next_pow2(n_rows))
        elems = rows * bd
        num_warps = min(16, max(4, elems // 512))
        runnable(_rms_norm_kernel, x.device)[(triton.cdiv(n_rows, rows),)](
            x3, r3, weight, normed, summed if summed is not None else normed, n_rows, x3.shape[1],
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), float(eps),
            D=d, BD=bd, ROWS=rows, HAS_RES=residual is not None, num_warps=num_warps)
    return normed if residual is None else (normed, summed)


def _check_triton(x, weight, residual, out) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x dtype {x.dtype} is not one of {_DTYPES}")
    if x.stride(-1) != 1:
        raise ValueError(f"rms_norm: x needs a unit stride on its last dim, got strides {x.stride()}")
    if weight.stride(0) != 1 or not weight.dtype.is_floating_point:
        raise ValueError(f"rms_norm: weight must be a contiguous float [D], got {weight.dtype} strides "
                         f"{weight.stride()}")
    if residual is not None and (residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual must be {x.dtype} with a unit stride on its last dim, got "
                         f"{residual.dtype} strides {residual.stride()}")
    if out is not None and (out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"rms_norm: out must be a contiguous {x.dtype} tensor, got {out.dtype} strides "
                         f"{out.stride()}")
    devices = {t.device for t in (x, weight, residual, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"rms_norm: tensors on several devices {devices}")


__all__ = ["rms_norm", "rms_norm_ref"]
