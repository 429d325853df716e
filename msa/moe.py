"""M3 MLPs: the dense SwiGLU-OAI MLP and the sigmoid-routed MoE block with a shared expert.

Sharding (docs/parallelism.md): the dense MLP and the shared expert split their intermediate dim over tp.
Routed experts:
  ep = 1: every rank holds every expert, its intermediate dim split over tp; routed and shared partial sums
          are added and reduced with one tp all-reduce.
  ep > 1: experts split by id over the ep group (`ctx.expert_range`), whole experts per rank. Each rank routes
          only its 1/tp slice of the step's tokens (`ctx.moe_token_slice`: the tp ranks hold the same tokens),
          sends each (token, expert) pair to the rank owning the expert with an all-to-all of uneven splits,
          runs its local experts on what it received, sends the outputs back with the reverse all-to-all and
          combines them with the routing weights. The tp all-reduce that sums the shared expert's partials
          also puts the tp ranks' token slices back together. `ctx.moe_dispatch = "allreduce"` replaces the
          two all-to-alls by an all-gather of the token slices and an all-reduce of the experts' partial sums
          (the first version, kept for comparison). `ctx.moe_dispatch = "capacity"` sends fixed-capacity
          buffers instead (`capacity_rows`): no split size is read on the host, so the forward can be captured
          in a CUDA graph (docs/parallelism.md, "Capacity dispatch").
The local experts run through `kernels.fused_moe.fused_moe` in both cases: on CUDA one grouped-GEMM kernel
chain with no host sync (the ep = 1 block is CUDA-graph capturable), on CPU the torch loop it is tested against.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_moe import MoEConfig, fused_moe
from kernels.router import router_select
from msa.config import M3Config
from msa.layers import swiglu_oai_packed
from msa.linear import (ColumnParallelLinear, RowParallelLinear, WeightShapeError, check_shape, new_param, read,
                        replicated_loader)
from msa.parallel import (ParallelContext, all_gather_varlen, all_reduce, all_to_all,
                          all_to_all_equal)


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
        # None: the fused selection kernel on CUDA (kernels/router.py; GPU test and decode bench D2 in
        # docs/benchmarks.md), torch's elsewhere; "ref" / "triton" force one. M3SERVE_FUSED_ROUTER=0 in the
        # environment keeps torch's selection on CUDA too (a check against the reference path).
        self.backend: str | None = "ref" if os.environ.get("M3SERVE_FUSED_ROUTER") == "0" else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k] int64, weights [T, k] fp32). The GEMM is torch's; the selection is
        one kernel on CUDA (kernels/router.py), torch's elsewhere or with `backend` "ref"."""
        logits = F.linear(x.float(), self.weight)
        return router_select(logits, self.e_score_correction_bias, self.top_k, self.scaling, backend=self.backend)


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
        # None: the fused Triton kernel on CUDA, the torch loop elsewhere; "ref" / "triton" force one
        # (benchmarks time the loop on the GPU with "ref"). config: a launch config override (None: by shape).
        self.backend: str | None = None
        self.config: MoEConfig | None = None

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

        On CUDA the fused grouped-GEMM kernel (kernels/fused_moe.py: pairs sorted by expert on the device,
        SwiGLU-OAI fused, no host sync, so the block can be captured in a CUDA graph); elsewhere, or with
        `backend = "ref"`, the torch loop over the experts that received pairs (one host sync)."""
        return fused_moe(x, ids, weights, self.gate_up_proj, self.down_proj, alpha=self.alpha, limit=self.limit,
                         expert_start=self.experts.start, config=self.config, backend=self.backend)

    def forward_rows(self, rows: torch.Tensor, local_ids: torch.Tensor, *, sync_free: bool = False) -> torch.Tensor:
        """rows [n, H], each for local expert local_ids[n] (any order) -> unweighted outputs [n, H], same order.
        A row whose id is not a local expert (the capacity dispatch's padding rows carry -1) gets zeros.

        sync_free: never read the device on the host. The fused kernel on CUDA already does not; elsewhere (or
        with backend "ref") the torch loop reads how many rows each expert got, so then every local expert
        runs over every row and keeps its own rows (E_local times the work: the CPU tier's price for checking
        the capturable path)."""
        ones = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
        if sync_free and not (rows.is_cuda and self.backend != "ref"):
            return self._masked_rows(rows, local_ids)
        return fused_moe(rows, local_ids.view(-1, 1), ones, self.gate_up_proj, self.down_proj, alpha=self.alpha,
                         limit=self.limit, expert_start=0, config=self.config, backend=self.backend)

    def _masked_rows(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(rows)
        for e in range(self.gate_up_proj.shape[0]):
            y = F.linear(swiglu_oai_packed(F.linear(rows, self.gate_up_proj[e]), self.alpha, self.limit),
                         self.down_proj[e])
            out = torch.where((local_ids == e)[:, None], y, out)
        return out


class SparseMoE(nn.Module):
    """y = sum_e w_e Expert_e(h) + Shared(h); the shared expert is not scaled.

    With the all-to-all dispatch, `sent_pairs[r]` / `received_pairs[r]` accumulate the (token, expert) pairs
    this rank sent to / received from ep rank r (host ints the all-to-all needs anyway; tests read them to
    check how uneven a split was)."""

    def __init__(self, config: M3Config, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        self.ctx = ctx
        self.gate = Router(config, device=device)
        self.experts = Experts(config, ctx, dtype=dtype, device=device)
        self.shared_experts = (DenseMLP(config, config.shared_intermediate_size, ctx, dtype=dtype, device=device,
                                        reduce=False) if config.n_shared_experts else None)
        self.sent_pairs = [0] * ctx.ep_size
        self.received_pairs = [0] * ctx.ep_size

    def forward(self, x: torch.Tensor, group_tokens: int | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. group_tokens (capacity dispatch only): the token count every rank of the ep group
        sizes its buffers from, the same on all of them (None: T, which the ranks share unless dp ranks in
        lockstep run steps of different sizes: then the caller passes the largest, see `capacity_rows`)."""
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.ctx.ep_size == 1:
            ids, weights = self.gate(x)
            routed = self.experts(x, ids, weights)
            # routed and shared partials are both split over tp: one all-reduce sums them together
            return all_reduce(routed if shared is None else routed + shared, self.ctx)
        first, count = self.ctx.moe_token_slice(x.shape[0])
        mine = x[first:first + count]
        if self.ctx.moe_dispatch == "alltoall":
            routed = self._alltoall(mine)
        elif self.ctx.moe_dispatch == "capacity":
            routed = self.routed_capacity(mine, x.shape[0] if group_tokens is None else group_tokens)
        else:
            routed = self._gather_allreduce(mine)
        if self.ctx.tp_size == 1:
            return routed if shared is None else routed + shared
        # one tp all-reduce sums the shared partials and reassembles the tp ranks' token slices
        full = shared if shared is not None else torch.zeros_like(x)
        full[first:first + count] += routed
        return all_reduce(full, self.ctx)

    def _alltoall(self, x: torch.Tensor) -> torch.Tensor:
        """x [t, H] (this rank's tokens) -> routed output [t, H], experts run where they live."""
        ep, per = self.ctx.ep_size, len(self.experts.experts)
        ids, weights = self.gate(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        # pairs sorted by expert id are grouped by owner rank (contiguous expert ranges), then by local expert
        order = torch.argsort(flat, stable=True)
        send_counts = torch.bincount(flat, minlength=self.experts.num_experts).view(ep, per)
        recv_counts = all_to_all_equal(send_counts, self.ctx, "ep")  # [source rank, local expert]
        per_source = recv_counts.tolist()  # the one host sync of the dispatch (split sizes must be on the host)
        send_splits = send_counts.sum(1).tolist()
        recv_splits = [sum(c) for c in per_source]
        token_of_pair = order // k
        received = all_to_all(x[token_of_pair], send_splits, recv_splits, self.ctx, "ep")
        # what arrived is source-major; the local expert of each row, then all local experts in one fused call
        expert_of_row = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(ep),
                                                recv_counts.reshape(-1), output_size=sum(recv_splits))
        outputs = self.experts.forward_rows(received, expert_of_row)
        returned = all_to_all(outputs, recv_splits, send_splits, self.ctx, "ep")  # back in `order` order
        out = torch.zeros_like(x)
        out.index_add_(0, token_of_pair, returned * weights.reshape(-1)[order, None].to(x.dtype))
        self._log(send_splits, recv_splits)
        return out

    def routed_capacity(self, x: torch.Tensor, group_tokens: int) -> torch.Tensor:
        """x [t, H] (this rank's tokens) -> routed output [t, H], with no host read of a device value.
        The capacity dispatch's routed half (`forward` adds the shared expert and the tp all-reduce); at ep = 1
        it runs the same code over one rank, which is how one GPU checks its capture.

        Every rank sends every ep peer a buffer of `capacity_rows(...)` rows (a bound no routing can exceed, so
        nothing is dropped) and a side tensor of each row's local expert id (-1: padding). Pair p = (token
        p // k, slot p % k) goes to row `slot_of_pair[p]` of its owner's buffer: its rank among the pairs this
        rank sends to that owner, in pair order (a cumulative sum, on the device). The receiver runs its experts
        on all ep * capacity rows (padding rows give zeros and are never read), the reverse all-to-all brings
        each row back to the same place in the sender's buffer, and the sender reads its pairs from there."""
        ep, per = self.ctx.ep_size, len(self.experts.experts)
        ids, weights = self.gate(x)
        t, k = ids.shape
        cap = capacity_rows(group_tokens, k, self.ctx, per)
        flat = ids.reshape(-1)
        owner = torch.div(flat, per, rounding_mode="floor")
        # one-hot of each pair's owner (no F.one_hot: it checks its input's range on the host)
        to_owner = (owner[:, None] == torch.arange(ep, device=x.device)).to(torch.int64)
        rank_in_owner = (to_owner.cumsum(0) * to_owner).sum(1) - 1
        slot_of_pair = owner * cap + rank_in_owner  # row of the flattened [ep * cap] send buffer
        rows = x.new_zeros((ep * cap, x.shape[1]))
        rows.index_copy_(0, slot_of_pair, x[:, None, :].expand(t, k, x.shape[1]).reshape(t * k, x.shape[1]))
        local = torch.full((ep * cap,), -1, dtype=torch.int64, device=x.device)
        local.index_copy_(0, slot_of_pair, flat - owner * per)
        received = all_to_all_equal(rows, self.ctx, "ep")  # [source rank's cap rows] * ep
        received_ids = all_to_all_equal(local, self.ctx, "ep")
        outputs = self.experts.forward_rows(received, received_ids, sync_free=True)
        returned = all_to_all_equal(outputs, self.ctx, "ep")  # each row back where its sender put it
        per_pair = returned.index_select(0, slot_of_pair).view(t, k, x.shape[1])
        return (per_pair * weights[:, :, None].to(x.dtype)).sum(1)

    def _gather_allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [t, H] -> routed output [t, H]: every rank runs its experts on the whole ep group's tokens."""
        everyone, counts = all_gather_varlen(x, self.ctx, "ep")
        ids, weights = self.gate(everyone)
        partial = all_reduce(self.experts(everyone, ids, weights), self.ctx, "ep")
        first = sum(counts[:self.ctx.ep_rank])
        return partial[first:first + x.shape[0]]

    def _log(self, sent: list[int], received: list[int]) -> None:
        for r in range(self.ctx.ep_size):
            self.sent_pairs[r] += sent[r]
            self.received_pairs[r] += received[r]


def capacity_rows(group_tokens: int, top_k: int, ctx: ParallelContext, experts_per_rank: int) -> int:
    """Rows of the capacity dispatch's buffer for each ep peer: the most (token, expert) pairs one rank can
    send to one peer. A rank routes at most ceil(group_tokens / tp) tokens (its `moe_token_slice`), and a
    token's top-k experts are distinct, so at most min(top_k, experts_per_rank) of them live on one peer.
    A worst-case bound from the shapes alone, the same on every rank of the ep group when `group_tokens` is."""
    tokens = -(-group_tokens // ctx.tp_size) if ctx.tp_size > 1 else group_tokens
    return max(tokens * min(top_k, experts_per_rank), 1)


__all__ = ["DenseMLP", "Router", "Experts", "SparseMoE", "capacity_rows"]
