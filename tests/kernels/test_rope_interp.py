"""The fused per-head norm + partial RoPE (kernels/rope.py) vs its reference on CPU through the Triton
interpreter, and the reference vs the model's own two steps (msa.layers rms_norm then apply_rope)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.rope import qk_norm_rope, qk_norm_rope_ref  # noqa: E402
from msa.layers import RotaryEmbedding, apply_rope, rms_norm  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here", allow_module_level=True)


def _inputs(t, heads, d, rd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(t, max(heads, 1) * d + 8, generator=g).to(dtype)  # a strided view of a wider projection
    x = fused[:, 8:].view(t, heads, d) if heads else fused[:, 8:8 + d]
    w = (torch.randn(d, generator=g) * 0.1).to(dtype)
    cos, sin = RotaryEmbedding(rd, 10000.0, device="cpu").cos_sin(torch.randint(0, 5000, (t,), generator=g))
    return x, w, cos, sin


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("heads,d,rd", [(4, 32, 16), (3, 48, 16), (0, 32, 32), (8, 128, 64)])
def test_fused_norm_rope_matches_the_two_steps(dtype, tol, heads, d, rd):
    x, w, cos, sin = _inputs(7, heads, d, rd, dtype)
    want = apply_rope(rms_norm(x, w, 1e-6), cos, sin)
    assert torch.equal(qk_norm_rope_ref(x, w, 1e-6, cos, sin), want)
    got = qk_norm_rope(x, w, 1e-6, cos, sin, backend="triton")
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_zero_weight_is_the_identity_scale_and_bad_shapes_are_named():
    x, w, cos, sin = _inputs(5, 2, 16, 8, torch.float32, seed=3)
    got = qk_norm_rope(x, torch.zeros_like(w), 1e-6, cos, sin, backend="triton")
    xf = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(got[..., 8:], xf[..., 8:], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope(x, w, 1e-6, cos[:4], sin[:4])
