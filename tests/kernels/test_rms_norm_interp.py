"""The Gemma RMSNorm kernel (kernels/rms_norm.py) vs its torch reference on CPU, through the Triton interpreter
(fp32/fp16, tiny shapes): widths that are and are not powers of two, with and without the residual add, 1-d to 4-d
inputs, strided row views of a fused projection output, eps, a zero weight, a poisoned `out`.

TRITON_INTERPRET is set by tests/kernels/conftest.py before triton is first imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here (see test_rms_norm_gpu.py)", allow_module_level=True)

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _rnd(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _old_path(x, w, eps, residual=None):
    """msa/layers.py's norm before the kernel, verbatim: the reference must equal it bit for bit."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (7, 130), (3, 256), (9, 4, 128), (6, 3, 48), (2, 3, 2, 130), (130,)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, shape, with_residual):
    d = shape[-1]
    x = (_rnd(*shape, seed=1, scale=3.0)).to(dtype)
    w = (_rnd(d, seed=2, scale=0.3)).to(dtype)
    res = _rnd(*shape, seed=3).to(dtype) if with_residual else None
    got = rms_norm(x, w, 1e-6, residual=res, backend="triton")
    want = rms_norm_ref(x, w, 1e-6, residual=res)
    old_normed, old_summed = _old_path(x, w, 1e-6, res)
    if with_residual:
        (got, got_sum), (want, want_sum) = got, want
        assert torch.equal(got_sum, want_sum) and torch.equal(want_sum, old_summed)  # rounded in the activation dtype
        assert got_sum.dtype == dtype and got_sum.shape == x.shape
    assert torch.equal(want, old_normed)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.float32:
        assert ((got - want).norm() / want.norm()).item() <= 1e-6


def test_fp16_residual_sum_rounds_before_the_norm():
    # values whose fp16 sum loses bits: the norm must see the rounded sum, as the model's `x + residual` does
    x = torch.full((2, 48), 1024.0, dtype=torch.float16)
    r = _rnd(2, 48, seed=4, scale=0.4).to(torch.float16)
    (got, s), (want, ws) = (rms_norm(x, torch.zeros(48, dtype=torch.float16), 1e-6, residual=r, backend=b)
                            for b in ("triton", "ref"))
    assert torch.equal(s, ws) and torch.equal(s, x + r)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("with_residual", [False, True])
def test_strided_row_views(with_residual):
    # q / k columns of a fused qkv projection: [T, (Hq + 2 Hkv) * D] viewed as [T, Hq, D] and [T, Hkv, D]
    t, hq, hkv, d = 6, 4, 2, 48
    qkv = _rnd(t, (hq + 2 * hkv) * d, seed=5)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    assert not q.is_contiguous() and q.stride() == ((hq + 2 * hkv) * d, d, 1)
    w = _rnd(d, seed=6, scale=0.2)
    for x in (q, k, qkv[:, :130]):  # 3-d views and a 2-d row-strided slice
        wx = w if x.shape[-1] == d else _rnd(x.shape[-1], seed=7, scale=0.2)
        res = _rnd(*x.shape, seed=8) if with_residual else None
        got = rms_norm(x, wx, 1e-6, residual=res, backend="triton")
        want = rms_norm_ref(x, wx, 1e-6, residual=res)
        if with_residual:
            assert torch.equal(got[1], want[1])
            got, want = got[0], want[0]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # a strided residual too (the sum is always a new contiguous tensor)
    res = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    got, s = rms_norm(k, w, 1e-6, residual=res, backend="triton")
    want, ws = rms_norm_ref(k, w, 1e-6, residual=res)
    assert torch.equal(s, ws) and s.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 1.0])
def test_eps_and_zero_weight(eps):
    x = _rnd(4, 130, seed=9, scale=0.05)  # small values: eps matters
    zero = torch.zeros(130)
    got = rms_norm(x, zero, eps, backend="triton")
    torch.testing.assert_close(got, rms_norm_ref(x, zero, eps), rtol=1e-6, atol=1e-6)
    # a stored 0 is the identity scale: x / sqrt(mean(x^2) + eps)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if eps == 1e-6:  # at unit scale eps is negligible: unit RMS rows
        y = rms_norm(x * 20, zero, eps, backend="triton")
        torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(7, 130), (5, 3, 48), (33, 128)])
def test_out_is_written_everywhere(shape, with_residual):
    x = _rnd(*shape, seed=10)
    w = _rnd(shape[-1], seed=11, scale=0.3)
    res = _rnd(*shape, seed=12) if with_residual else None
    out = torch.full(shape, float("nan"))
    got = rms_norm(x, w, 1e-6, residual=res, out=out, backend="triton")
    normed = got[0] if with_residual else got
    assert normed is out
    assert not out.isnan().any()
    want = rms_norm_ref(x, w, 1e-6, residual=res)
    torch.testing.assert_close(out, want[0] if with_residual else want, rtol=1e-6, atol=1e-6)
    # the reference honours `out` the same way
    out2 = torch.full(shape, float("nan"))
    ref = rms_norm_ref(x, w, 1e-6, residual=res, out=out2)
    assert (ref[0] if with_residual else ref) is out2 and not out2.isnan().any()


def test_backend_choice_and_empty_input():
    x, w = _rnd(3, 48, seed=13), _rnd(48, seed=14)
    # backend None on CPU is the reference, bit for bit the old path
    assert torch.equal(rms_norm(x, w, 1e-6), _old_path(x, w, 1e-6)[0])
    empty = torch.empty(0, 48)
    assert rms_norm(empty, w, 1e-6, backend="triton").shape == (0, 48)
    n, s = rms_norm(empty, w, 1e-6, residual=empty, backend="triton")
    assert n.shape == s.shape == (0, 48)
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, w, 1e-6, backend="cuda")


def test_bad_inputs_are_refused():
    x, w = _rnd(3, 48, seed=15), _rnd(48, seed=16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, _rnd(47), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=_rnd(3, 47), backend="triton")
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=x.half(), backend="triton")
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(_rnd(48, 3).t(), w, 1e-6, backend="triton")
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, 1e-6, out=torch.empty(48, 3).t(), backend="triton")
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, 1e-6, out=torch.empty(3, 48, dtype=torch.float16), backend="triton")


def test_model_norm_module_uses_the_launcher():
    from msa.layers import RMSNorm, rms_norm as layers_rms_norm

    x, r = _rnd(4, 130, seed=17, scale=2.0), _rnd(4, 130, seed=18)
    norm = RMSNorm(130, 1e-6, dtype=torch.float32, device="cpu")
    norm.weight.data.copy_(_rnd(130, seed=19, scale=0.3))
    # CPU: exactly the old path
    old_n, old_s = _old_path(x, norm.weight, 1e-6, r)
    n, s = norm(x, r)
    assert torch.equal(n, old_n) and torch.equal(s, old_s)
    assert torch.equal(norm(x), _old_path(x, norm.weight, 1e-6)[0])
    assert torch.equal(layers_rms_norm(x, norm.weight, 1e-6), _old_path(x, norm.weight, 1e-6)[0])
