"""kernels/router.py (sigmoid, biased top-k, renormalised weights in one launch) against its torch reference on
CPU, through the Triton interpreter: M3's 128 experts / top-8 and small shapes, ties (the lower expert id wins),
a bias that reorders the choice, and zero rows.

TRITON_INTERPRET is set by tests/kernels/conftest.py before triton is first imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels.router import router_select, router_select_ref  # noqa: E402

if torch.cuda.is_available():
    pytest.skip("CUDA machine: Triton compiles for the GPU here", allow_module_level=True)


@pytest.mark.parametrize("rows,experts,k", [(1, 128, 8), (37, 128, 4), (5, 8, 2), (3, 24, 5)])
def test_router_select_matches_the_torch_path(rows, experts, k):
    g = torch.Generator().manual_seed(rows * experts + k)
    logits = torch.randn(rows, experts, generator=g) * 3
    bias = torch.randn(experts, generator=g) * 0.1
    want_ids, want_w = router_select_ref(logits, bias, k, 2.5)
    ids, w = router_select(logits, bias, k, 2.5, backend="triton")
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, want_ids)  # distinct random scores: the same experts in the same (descending) order
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert_and_the_bias_decides():
    logits = torch.zeros(1, 16)
    logits[0, [3, 9, 12]] = 1.0  # three equal scores: top-2 must be 3 then 9
    ids, w = router_select(logits, torch.zeros(16), 2, 1.0, backend="triton")
    assert ids.tolist() == [[3, 9]]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))  # equal scores, equal weights
    bias = torch.zeros(16)
    bias[7] = 5.0  # all scores equal: the biased expert 7 first, then the lowest ids
    ids, w = router_select(torch.zeros(1, 16), bias, 3, 3.0, backend="triton")
    assert ids.tolist() == [[7, 0, 1]]
    torch.testing.assert_close(w, torch.full((1, 3), 1.0))  # the unbiased scores renormalised, times scaling


def test_zero_rows_and_bad_arguments():
    ids, w = router_select(torch.zeros(0, 8), torch.zeros(8), 2, 1.0, backend="triton")
    assert ids.shape == (0, 2) and w.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        router_select(torch.zeros(1, 8), torch.zeros(8), 9, 1.0, backend="triton")
    with pytest.raises(ValueError, match="fp32"):
        router_select(torch.zeros(1, 8, dtype=torch.float16), torch.zeros(8), 2, 1.0, backend="triton")
