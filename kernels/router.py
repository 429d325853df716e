"""The MoE router's selection in one launch: sigmoid, biased top-k, and the renormalised routing weights.

The router (msa/moe.py `Router`) scores experts with an fp32 GEMM, then
    s = sigmoid(logits); ids = top-k of (s + e_score_correction_bias); w = s[ids] / sum(s[ids]) * scaling.
In torch that tail is about nine kernels per MoE layer (sigmoid, add, two top-k kernels, gather, sum, divide,
multiply, a copy), each a few microseconds: at one decode row they cost more than the GEMM (H200 profile,
docs/benchmarks.md D1). Here one program per row does all of it on the row's E scores in registers; k rounds of
arg-max pick the experts (ties to the lower expert id: `torch.topk` leaves that order unspecified), in descending
order of the biased score as `torch.topk` returns them. The GEMM stays torch's, so the logits are the same
numbers either way. `router_select_ref` is the torch reference. The default on CUDA (msa/moe.py `Router.backend`;
M3SERVE_FUSED_ROUTER=0 turns it off): on the H200 it took 0.04-0.06 ms off the m3-slice decode replay at B = 1 / 16
/ 64 (docs/benchmarks.md D2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, runnable, use_triton


def router_select_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (expert ids [T, k] int64, weights [T, k] fp32): the torch path of `Router`."""
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(dim=-1, keepdim=True) * scaling


@triton.jit
def _router_select_kernel(lg_ptr, bias_ptr, ids_ptr, w_ptr, lg_st, ids_st, w_st, scaling,
                          E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    s = tl.sigmoid(tl.load(lg_ptr + t * lg_st + e, mask=ok, other=0.0))
    biased = tl.where(ok, s + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    picked = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(K):
        _, idx = tl.max(biased, axis=0, return_indices=True, return_indices_tie_break_left=True)
        ids = tl.where(kk == j, idx, ids)
        picked = tl.where(kk == j, tl.sum(tl.where(e == idx, s, 0.0), axis=0), picked)
        biased = tl.where(e == idx, float("-inf"), biased)
    w = picked / tl.sum(picked, axis=0) * scaling
    tl.store(ids_ptr + t * ids_st + kk, ids.to(tl.int64), mask=kk < K)
    tl.store(w_ptr + t * w_st + kk, w, mask=kk < K)


def router_select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, *,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 (the router GEMM's output), bias [E] fp32 -> (ids [T, k] int64, weights [T, k] fp32).
    backend None: the Triton kernel on CUDA, the torch reference elsewhere; "triton" / "ref" force one. No host
    syncs (CUDA-graph capturable)."""
    if not use_triton(logits.device, backend):
        return router_select_ref(logits, bias, top_k, scaling)
    t, e = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("router_select: logits and bias must be fp32, logits with a unit last stride")
    if not 0 < top_k <= e:
        raise ValueError(f"router_select: top_k {top_k} outside [1, {e}]")
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        block_e = max(16, next_pow2(e))
        runnable(_router_select_kernel, logits.device)[(t,)](
            logits, bias, ids, weights, logits.stride(0), ids.stride(0), weights.stride(0), float(scaling),
            E=e, BLOCK_E=block_e, K=top_k, BLOCK_K=max(2, next_pow2(top_k)), num_warps=1 if block_e <= 256 else 4)
    return ids, weights


__all__ = ["router_select", "router_select_ref"]
