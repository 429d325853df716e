"""The SwiGLU-OAI kernel (kernels/swiglu.py) vs its torch reference on CPU, through the Triton interpreter
(fp32/fp16): row counts that are not multiples of the program's rows, widths that are and are not powers of two
and wider than one program, rows at a stride (a fused projection's columns), values past the clamps, and a
poisoned neighbour that must stay untouched (every store masked).

TRITON_INTERPRET is set by tests/kernels/conftest.py before triton is first imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.swiglu import swiglu_oai, swiglu_oai_ref  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here (see test_swiglu_gpu.py)", allow_module_level=True)

ALPHA, LIMIT = 1.702, 7.0


def _rnd(*shape, seed=0, scale=4.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 48), (5, 1024), (7, 1030), (13, 2052)])
def test_swiglu_equals_the_reference_fp32(rows, inter):
    x = _rnd(rows, 2 * inter, seed=rows)  # scale 4: many gates above and ups beyond +-LIMIT
    got = swiglu_oai(x, ALPHA, LIMIT, backend="triton")
    assert got.shape == (rows, inter) and got.dtype == torch.float32
    torch.testing.assert_close(got, swiglu_oai_ref(x, ALPHA, LIMIT), rtol=1e-6, atol=1e-6)


def test_swiglu_fp16_and_3d_input():
    x = _rnd(2, 3, 96, seed=5, dtype=torch.float16)
    got = swiglu_oai(x, ALPHA, LIMIT, backend="triton")
    want = swiglu_oai_ref(x.float(), ALPHA, LIMIT).half()  # fp32 inside, one rounding
    assert got.shape == (2, 3, 48) and got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_swiglu_reads_rows_at_a_stride_and_writes_only_its_output():
    # columns [10, 10 + 2I) of a wider buffer: rows at a stride of 300, neighbours poisoned with NaN
    buf = torch.full((9, 300), float("nan"))
    buf[:, 10:10 + 2 * 40] = _rnd(9, 80, seed=7)
    x = buf[:, 10:10 + 80]
    assert x.stride(0) == 300
    got = swiglu_oai(x, ALPHA, LIMIT, backend="triton")
    torch.testing.assert_close(got, swiglu_oai_ref(x, ALPHA, LIMIT), rtol=1e-6, atol=1e-6)
    assert not got.isnan().any()


def test_swiglu_rejects_odd_widths_and_takes_empty_rows():
    with pytest.raises(ValueError, match="2I"):
        swiglu_oai(torch.zeros(3, 7), ALPHA, LIMIT, backend="triton")
    assert swiglu_oai(torch.zeros(0, 8), ALPHA, LIMIT, backend="triton").shape == (0, 4)
