"""M3 MLPs: the dense SwiGLU-OAI MLP and the sigmoid-routed MoE block with a shared expert.

Sharding: the dense MLP and the shared expert split their intermediate dim over tp. Routed experts split by
expert id over ep (`ctx.expert_range`) and, when ep = 1, by intermediate dim over tp. Each rank computes partial
sums for its experts / columns; one all-reduce combines them (DESIGN.md §3, first EP version; token
dispatch/combine with all-to-all replaces it later without changing the weights' layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from msa.config import M3Config
from msa.layers import swiglu_oai_packed
from msa.linear import (ColumnParallelLinear, RowParallelLinear, WeightShapeError, check_shape, new_param, read,
                        replicated_loader)
from msa.parallel import ParallelContext, all_reduce


class DenseMLP(nn.Module):
    """down(swiglu_oai(gate(h), up(h))); gate_up_proj holds [gate; up] rows (shard ids 0 = gate, 1 = up)."""

    def __init__(self, config: M3Config, intermediate_size: int, ctx: ParallelContext, *, dtype, device,
                 reduce: bool = True):
        super().__init__()
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [intermediate_size, intermediate_size], ctx,
                                                 dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, ctx, dtype=dtype, device=device,
                                           reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai_packed(self.gate_up_proj(x), self.alpha, self.limit))


class Router(nn.Module):
    """Sigmoid router in fp32. The correction bias only picks the experts; the weights are the unbiased
    sigmoid scores of the picked experts, renormalised to sum 1, times routed_scaling_factor."""

    def __init__(self, config: M3Config, *, device):
        super().__init__()
        e = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        # kept in fp32 whatever the model dtype (the hub checkpoint stores them in fp32)
        self.weight = new_param((e, config.hidden_size), torch.float32, device, replicated_loader)
        self.e_score_correction_bias = new_param((e,), torch.float32, device, replicated_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k] int64, weights [T, k] fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight))
        _, ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.scaling
        return ids, weights


class Experts(nn.Module):
    """This rank's routed experts: gate_up_proj [E_local, 2 I_local, H] (gate rows, then up rows) and
    down_proj [E_local, H, I_local].

    Loader shard ids: None = the packed tensor of all experts ([E, 2I, H] / [E, H, I], transformers layout);
    (e, "gate") / (e, "up") = one expert's w1 / w3 [I, H] and e = one expert's w2 [H, I] (hub layout).
    Experts outside this rank's range are skipped without reading.
    """

    def __init__(self, config: M3Config, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.num_experts, self.hidden = config.num_local_experts, config.hidden_size
        self.inter = config.intermediate_size
        self.experts = ctx.expert_range(self.num_experts)
        if self.inter % ctx.expert_tp_size:
            raise ValueError(f"intermediate_size: {self.inter} does not split over tp={ctx.expert_tp_size}")
        self.inter_local = self.inter // ctx.expert_tp_size
        self.inter_start = ctx.expert_tp_rank * self.inter_local
        n, i, h = len(self.experts), self.inter_local, self.hidden
        gate_up_ids = [(e, part) for e in range(self.num_experts) for part in ("gate", "up")]
        self.gate_up_proj = new_param((n, 2 * i, h), dtype, device, self._load_gate_up, gate_up_ids)
        self.down_proj = new_param((n, h, i), dtype, device, self._load_down, range(self.num_experts))

    def _rows(self, base: int = 0) -> slice:
        return slice(base + self.inter_start, base + self.inter_start + self.inter_local)

    def _load_gate_up(self, param: nn.Parameter, src, shard_id=None) -> None:
        e0, e1, i = self.experts.start, self.experts.stop, self.inter_local
        if shard_id is None:
            check_shape(src, (self.num_experts, 2 * self.inter, self.hidden), "packed experts gate_up")
            param.data[:, :i].copy_(read(src, (slice(e0, e1), self._rows(0), slice(None))))
            param.data[:, i:].copy_(read(src, (slice(e0, e1), self._rows(self.inter), slice(None))))
            return
        e, part = shard_id
        if part not in ("gate", "up") or not 0 <= e < self.num_experts:
            raise WeightShapeError(f"unknown expert shard {shard_id!r}")
        check_shape(src, (self.inter, self.hidden), f"expert {e} {part}")
        if e in self.experts:
            dst = slice(0, i) if part == "gate" else slice(i, 2 * i)
            param.data[e - e0, dst].copy_(read(src, (self._rows(), slice(None))))

    def _load_down(self, param: nn.Parameter, src, shard_id=None) -> None:
        e0, e1 = self.experts.start, self.experts.stop
        if shard_id is None:
            check_shape(src, (self.num_experts, self.hidden, self.inter), "packed experts down")
            param.data.copy_(read(src, (slice(e0, e1), slice(None), self._rows())))
            return
        e = shard_id
        if not isinstance(e, int) or not 0 <= e < self.num_experts:
            raise WeightShapeError(f"unknown expert shard {shard_id!r}")
        check_shape(src, (self.hidden, self.inter), f"expert {e} down")
        if e in self.experts:
            param.data[e - e0].copy_(read(src, (slice(None), self._rows())))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; ids, weights [T, k] -> partial sum over this rank's experts [T, H] (not reduced).

        Batched by expert: the (token, slot) pairs are sorted by expert id, then each local expert that received
        tokens runs one GEMM pair over its contiguous run (a fused grouped-GEMM kernel replaces this loop).
        """
        out = torch.zeros_like(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        begin = sum(counts[:self.experts.start])  # pairs routed to experts of lower ranks come first
        flat_w = weights.reshape(-1)
        for local, n in enumerate(counts[self.experts.start:self.experts.stop]):
            if n == 0:
                continue
            pairs = order[begin:begin + n]
            begin += n
            tokens = pairs // k
            act = swiglu_oai_packed(F.linear(x[tokens], self.gate_up_proj[local]), self.alpha, self.limit)
            y = F.linear(act, self.down_proj[local]) * flat_w[pairs, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        return out


class SparseMoE(nn.Module):
    """y = sum_e w_e Expert_e(h) + Shared(h); the shared expert is not scaled."""

    def __init__(self, config: M3Config, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        self.ctx = ctx
        self.gate = Router(config, device=device)
        self.experts = Experts(config, ctx, dtype=dtype, device=device)
        self.shared_experts = (DenseMLP(config, config.shared_intermediate_size, ctx, dtype=dtype, device=device,
                                        reduce=False) if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        routed = self.experts(x, ids, weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.ctx.ep_size == 1:
            # routed and shared partials are both split over tp: one all-reduce sums them together
            return all_reduce(routed if shared is None else routed + shared, self.ctx)
        routed = all_reduce(routed, self.ctx, axis="ep")
        return routed if shared is None else routed + all_reduce(shared, self.ctx)


__all__ = ["DenseMLP", "Router", "Experts", "SparseMoE"]
