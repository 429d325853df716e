"""The Gemma RMSNorm kernel vs its torch reference on the GPU at the real M3 shapes (bf16): the hidden norms
[8192, 6144] with and without the residual add, per-head norms [8192, 64, 128] (also as a strided view of a fused
projection), and the launcher under CUDA-graph capture and replay."""
from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm, rms_norm_ref

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(8192, 6144), (8192, 64, 128), (3, 6144), (1, 4, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gpu(shape, with_residual):
    g = torch.Generator(device="cuda").manual_seed(len(shape))
    x = (torch.randn(*shape, device="cuda", generator=g) * 3).bfloat16()
    w = (torch.randn(shape[-1], device="cuda", generator=g) * 0.3).bfloat16()
    res = torch.randn(*shape, device="cuda", generator=g).bfloat16() if with_residual else None
    got = rms_norm(x, w, 1e-6, residual=res)  # backend None on CUDA: Triton
    want = rms_norm_ref(x, w, 1e-6, residual=res)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the bf16 sum rounds exactly like torch's x + residual
        got, want = got[0], want[0]
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _rel(got, want) < 1e-2
    # the same rounding steps as the torch path: nearly every element bitwise equal
    assert (got == want).float().mean() > 0.99


def test_rms_norm_strided_heads_gpu():
    t, hq, hkv, d = 8192, 64, 4, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).bfloat16()
    q = qkv[:, :hq * d].view(t, hq, d)
    w = (torch.randn(d, device="cuda", generator=g) * 0.3).bfloat16()
    assert _rel(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6)) < 1e-2


@pytest.mark.parametrize("shape", [(8192, 6144), (8192, 64, 128)])
def test_rms_norm_captures_in_a_cuda_graph(shape):
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
    res = torch.empty_like(x)
    w = (torch.randn(shape[-1], device="cuda", generator=g) * 0.3).bfloat16()
    out = torch.empty_like(x)

    def step():
        normed, summed = rms_norm(x, w, 1e-6, residual=res)
        return normed, summed, rms_norm(summed, w, 1e-6, out=out)

    x.normal_(generator=g)
    res.normal_(generator=g)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed, plain = step()
    x.normal_(generator=g)
    res.normal_(generator=g)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, want_sum = rms_norm_ref(x, w, 1e-6, residual=res)
    assert torch.equal(summed, want_sum)
    assert _rel(normed, want) < 1e-2
    assert plain is out and not out.isnan().any()
    assert _rel(out, rms_norm_ref(want_sum, w, 1e-6)) < 1e-2
