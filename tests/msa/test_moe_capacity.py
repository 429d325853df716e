"""The capacity EP dispatch's routed half (`SparseMoE.routed_capacity`, msa/moe.py) on one rank: at ep = 1 the
same code runs with the all-to-alls as identities, so one device checks its buffers, padding rows and combine
against the ep = 1 experts path, and (on CUDA) that the whole of it is captured in a CUDA graph and replays
equal to eager. The multi-rank cases are in test_parallel_forward.py (gloo) and
tests/workers/test_cuda_graph_multigpu.py (NCCL, 2 GPUs).
"""
from __future__ import annotations

import pytest
import torch

from msa.moe import SparseMoE, capacity_rows
from msa.parallel import ParallelContext

SEED = 0


def _moe(model) -> SparseMoE:
    return next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))


def _routed(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    ids, weights = moe.gate(x)
    return moe.experts(x, ids, weights)


def test_capacity_rows_bound_every_routing():
    one = ParallelContext.single()
    assert capacity_rows(13, 2, one, 8) == 26
    assert capacity_rows(13, 8, one, 4) == 52  # a token's distinct experts: at most 4 on one rank
    assert capacity_rows(0, 2, one, 8) == 1  # an idle group still exchanges a (padding) row


@torch.inference_mode()
@pytest.mark.parametrize("group_tokens", [None, 32])
def test_routed_capacity_on_one_rank_equals_the_experts_path(ckpts, tiny_cfg, group_tokens):
    model = ckpts.model(tiny_cfg, SEED, "hub")
    moe = _moe(model)
    x = torch.randn(13, tiny_cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    # group_tokens 32: buffers for a larger step than this rank's (what a lockstep dp rank with fewer rows
    # runs): the extra rows are padding, ignored by the experts and never read back
    got = moe.routed_capacity(x, group_tokens or x.shape[0])
    torch.testing.assert_close(got, _routed(moe, x), rtol=1e-5, atol=1e-5)
    assert moe.routed_capacity(x[:0], group_tokens or 1).shape == (0, tiny_cfg.hidden_size)


@pytest.mark.gpu
@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_capacity_captures_in_a_cuda_graph_and_replays_equal_to_eager(ckpts, tiny_cfg, dtype):
    model = ckpts.model(tiny_cfg, SEED, "hub", device="cuda", dtype=dtype)
    moe = _moe(model)
    gen = torch.Generator(device="cuda").manual_seed(2)
    tokens, bucket = 13, 16
    static = torch.zeros(bucket, tiny_cfg.hidden_size, device="cuda", dtype=dtype)
    static[:tokens] = torch.randn(tokens, tiny_cfg.hidden_size, device="cuda", generator=gen, dtype=dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe.routed_capacity(static, bucket)  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_capacity(static, bucket)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step in range(3):  # new inputs into the static buffer, replayed
        static.copy_(torch.randn(bucket, tiny_cfg.hidden_size, device="cuda", generator=gen, dtype=dtype))
        graph.replay()
        eager = moe.routed_capacity(static, bucket)
        torch.testing.assert_close(out.float(), eager.float(), rtol=tol, atol=tol)  # same kernels, same inputs
        torch.testing.assert_close(out.float(), _routed(moe, static).float(), rtol=tol, atol=tol)
