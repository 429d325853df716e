"""The SwiGLU-OAI kernel vs its reference on the GPU at the real M3 shapes (bf16 and fp32): the dense MLP's
and shared experts' [T, 2I] widths, odd token counts (mixed prefill + decode steps), a strided view,
and CUDA-graph capture; the output buffer's neighbours stay untouched."""
from __future__ import annotations

import pytest
import torch

from kernels.swiglu import swiglu_oai, swiglu_oai_ref

pytestmark = pytest.mark.gpu
ALPHA, LIMIT = 1.702, 7.0


@pytest.mark.parametrize("rows", [1, 3, 8191, 8192])
@pytest.mark.parametrize("inter", [1536, 3072, 12288])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_gpu(rows, inter, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows + inter)
    x = (torch.randn(rows, 2 * inter, device="cuda", generator=g) * 4).to(dtype)
    got = swiglu_oai(x, ALPHA, LIMIT)  # backend None on CUDA: Triton
    want = swiglu_oai_ref(x.float(), ALPHA, LIMIT)  # fp32 math, as the kernel
    assert got.dtype == dtype and got.shape == (rows, inter) and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_swiglu_gpu_strided_rows_and_graph_replay():
    g = torch.Generator(device="cuda").manual_seed(1)
    buf = torch.randn(77, 2 * 1536 + 64, device="cuda", generator=g).bfloat16()
    x = buf[:, 32:32 + 2 * 1536]
    want = swiglu_oai_ref(x.float(), ALPHA, LIMIT)
    swiglu_oai(x, ALPHA, LIMIT)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = swiglu_oai(x, ALPHA, LIMIT)
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out.float(), want, rtol=8e-3, atol=8e-3)
