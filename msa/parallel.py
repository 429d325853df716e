"""The explicit parallel context of one shard and every collective the model runs.

Nothing here is global: each layer receives a `ParallelContext` when it is built and passes it to the
collectives below. With a group size of 1 every collective is a no-op, so the single-shard model pays nothing.

Axes of one worker group of `world_size = tp * dp` ranks (docs/parallelism.md):
  tp: tensor parallel (attention heads, dense MLP / shared expert columns+rows, vocab); a tp group is `tp`
      consecutive world ranks and runs one batch.
  dp: attention data parallel; world rank r is dp rank r // tp. Each dp rank runs attention on its own requests
      with its own KV pages. The dp group links the ranks with the same tp rank.
  ep: expert parallel; experts split by id over `ep` consecutive world ranks (ep divides tp * dp). With ep > 1
      each rank dispatches its share of the tokens to the ranks owning their experts (all-to-all) and combines
      the results; with ep = 1 every tp group holds all experts, split by intermediate dim over tp.

`init_parallel` builds the context (and the process groups) from a world rank and the sizes; the worker side
calls it once in each shard process.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

MOE_DISPATCH_MODES = ("alltoall", "allreduce", "capacity")


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """This shard's position on each parallel axis; groups are torch.distributed process groups or None.

    moe_dispatch (ep > 1 only): "alltoall" sends each token to the ranks owning its experts and back;
    "allreduce" gathers every token of the ep group on every rank, runs the local experts on all of them and
    sums the partial outputs with one all-reduce (the first version, kept for comparison); "capacity" is the
    all-to-all with fixed-size buffers and no host read (capturable in a CUDA graph; msa/moe.py).
    """

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Any = None
    world_size: int = 1
    world_rank: int = 0
    world_group: Any = None
    moe_dispatch: str = "alltoall"

    def __post_init__(self) -> None:
        for axis in ("tp", "ep", "dp", "world"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{axis}_rank: {rank} is not a rank of a group of size {size}")
            if size > 1 and getattr(self, f"{axis}_group") is None:
                raise ValueError(f"{axis}_group: a process group is required when {axis}_size = {size} > 1")
        if self.moe_dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"moe_dispatch: {self.moe_dispatch!r} is not one of {MOE_DISPATCH_MODES}")

    @classmethod
    def single(cls) -> ParallelContext:
        """One shard holding the whole model."""
        return cls()

    # ---- how the model's dimensions split over this shard -----------------------------------------------
    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this tp rank holds. With tp > num_kv_heads each KV head is replicated on
        tp / num_kv_heads consecutive ranks so that every rank holds whole KV groups."""
        tp = self.tp_size
        if num_kv_heads >= tp:
            if num_kv_heads % tp:
                raise ValueError(f"num_key_value_heads: {num_kv_heads} does not split over tp={tp}")
            per = num_kv_heads // tp
            return self.tp_rank * per, per
        if tp % num_kv_heads:
            raise ValueError(f"tp_size: {tp} must be a multiple of num_key_value_heads={num_kv_heads} to replicate")
        return self.tp_rank // (tp // num_kv_heads), 1

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(offset, length) of this tp rank's equal share of a dimension of `size`."""
        if size % self.tp_size:
            raise ValueError(f"{what}: {size} does not split over tp={self.tp_size}")
        per = size // self.tp_size
        return self.tp_rank * per, per

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this ep rank holds (a contiguous range)."""
        if num_experts % self.ep_size:
            raise ValueError(f"num_local_experts: {num_experts} does not split over ep={self.ep_size}")
        per = num_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    @property
    def expert_tp_size(self) -> int:
        """Ranks that split one expert's intermediate dimension: tp when experts are not split by id."""
        return self.tp_size if self.ep_size == 1 else 1

    @property
    def expert_tp_rank(self) -> int:
        return self.tp_rank if self.ep_size == 1 else 0

    def moe_token_slice(self, num_tokens: int) -> tuple[int, int]:
        """(first, count) of the step's tokens this rank routes through the experts when ep > 1.

        Every rank of a tp group holds the same tokens after attention; dispatching all of them from each tp
        rank would send (and compute) every token tp times. So tp rank r routes only tokens
        [T r / tp, T (r + 1) / tp) and the tp all-reduce after the MoE block puts the pieces back together.
        With ep = 1 the experts are tp-sharded and every rank needs every token: the whole batch."""
        if self.ep_size == 1 or self.tp_size == 1:
            return 0, num_tokens
        first = num_tokens * self.tp_rank // self.tp_size
        return first, num_tokens * (self.tp_rank + 1) // self.tp_size - first

    @property
    def dp_ranks_in_lockstep(self) -> bool:
        """True when the forward runs collectives that span several dp ranks (an ep group wider than a tp
        group): then every dp rank must run every step, an idle one with an empty batch."""
        return self.dp_size > 1 and self.ep_size > self.tp_size


# ---- building the groups ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Which world ranks form each group, for a world of tp * dp ranks (the same on every rank)."""

    tp: int
    ep: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.ep:
            raise ValueError(f"ep: {self.ep} must divide tp * dp = {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def tp_groups(self) -> list[list[int]]:
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [list(range(t, self.world_size, self.tp)) for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        return [list(range(b * self.ep, (b + 1) * self.ep)) for b in range(self.world_size // self.ep)]

    def ranks(self, world_rank: int) -> dict[str, int]:
        """{"tp": ..., "dp": ..., "ep": ...} ranks of `world_rank` on each axis."""
        if not 0 <= world_rank < self.world_size:
            raise ValueError(f"rank: {world_rank} is not a rank of a world of tp * dp = {self.world_size}")
        return {"tp": world_rank % self.tp, "dp": world_rank // self.tp, "ep": world_rank % self.ep}


def init_parallel(rank: int, world_size: int, *, tp: int = 1, ep: int = 1, dp: int = 1,
                  init_method: str | None = None, store: Any = None, backend: str = "gloo",
                  moe_dispatch: str = "alltoall", timeout_s: float = 600.0,
                  device: torch.device | str | None = None) -> ParallelContext:
    """Join the worker group's default process group and build this rank's context with its tp/dp/ep groups.

    Exactly one of `init_method` (e.g. "tcp://host:port" from a free port the group picked, or "file://...")
    and `store` (a torch.distributed Store) says where the ranks meet; nothing here picks a port. backend:
    "gloo" (CPU) or "nccl" (one GPU per rank; pass `device` so NCCL binds the right one). Every rank must call
    this with the same sizes. A world of one rank creates no process group at all.
    """
    layout = RankLayout(tp=tp, ep=ep, dp=dp)
    if world_size != layout.world_size:
        raise ValueError(f"world_size: {world_size} != tp * dp = {tp} * {dp}")
    ranks = layout.ranks(rank)
    if world_size == 1:
        return ParallelContext(moe_dispatch=moe_dispatch)
    if (init_method is None) == (store is None):
        raise ValueError("init_method/store: give exactly one of them")
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size,
                              "timeout": timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs["init_method"] = init_method
    else:
        kwargs["store"] = store
    if device is not None and backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(**kwargs)
    groups: dict[str, Any] = {}
    # every rank creates every subgroup, in the same order (new_group is collective over the world)
    for axis, members in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()), ("ep", layout.ep_groups())):
        for ranks_of_group in members:
            if len(ranks_of_group) == 1:
                continue
            g = dist.new_group(ranks_of_group)
            if rank in ranks_of_group:
                groups[axis] = g
    return ParallelContext(tp_size=tp, tp_rank=ranks["tp"], tp_group=groups.get("tp"),
                           ep_size=ep, ep_rank=ranks["ep"], ep_group=groups.get("ep"),
                           dp_size=dp, dp_rank=ranks["dp"], dp_group=groups.get("dp"),
                           world_size=world_size, world_rank=rank, world_group=dist.group.WORLD,
                           moe_dispatch=moe_dispatch)


def destroy_parallel(ctx: ParallelContext) -> None:
    """Leave the worker group: a barrier first so no rank tears the group down under a peer's collective."""
    if ctx.world_size == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        barrier(ctx)
        dist.destroy_process_group()


# ---- collectives ----------------------------------------------------------------------------------------------

def _group(ctx: ParallelContext, axis: str) -> tuple[int, Any]:
    if axis not in ("tp", "ep", "dp", "world"):
        raise ValueError(f"axis: unknown parallel axis {axis!r}")
    return getattr(ctx, f"{axis}_size"), getattr(ctx, f"{axis}_group")


def all_reduce(x: torch.Tensor, ctx: ParallelContext, axis: str = "tp") -> torch.Tensor:
    """Sum `x` over the ranks of `axis` (in place when the group has more than one rank)."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1, axis: str = "tp") -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on every rank) along `dim` in rank order."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_gather_counts(n: int, ctx: ParallelContext, axis: str, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's integer `n`, in rank order (e.g. token counts)."""
    size, _ = _group(ctx, axis)
    if size == 1:
        return [n]
    return all_gather(torch.tensor([n], dtype=torch.int64, device=device), ctx, dim=0, axis=axis).tolist()


def all_gather_varlen(x: torch.Tensor, ctx: ParallelContext, axis: str) -> tuple[torch.Tensor, list[int]]:
    """Concatenate every rank's rows x [n_r, ...] (n_r may differ, even be 0) along dim 0 in rank order.
    Returns (rows [sum n_r, ...], [n_r per rank])."""
    size, _ = _group(ctx, axis)
    if size == 1:
        return x, [x.shape[0]]
    counts = all_gather_counts(x.shape[0], ctx, axis, x.device)
    most = max(counts)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:x.shape[0]] = x
    gathered = all_gather(padded, ctx, dim=0, axis=axis).view(size, most, *x.shape[1:])
    return torch.cat([gathered[r, :counts[r]] for r in range(size)]), counts


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], ctx: ParallelContext,
               axis: str = "ep") -> torch.Tensor:
    """Rows x [sum(send_splits), ...] -> [sum(recv_splits), ...]: the first send_splits[0] rows go to rank 0,
    and so on; the result holds rank 0's rows for this rank first (uneven splits, zeros allowed)."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all_equal(x: torch.Tensor, ctx: ParallelContext, axis: str = "ep") -> torch.Tensor:
    """x [size * n, ...] -> [size * n, ...]: rows [r n, (r + 1) n) go to rank r, and the result holds rank r's
    block for this rank at rows [r n, (r + 1) n). Equal splits: no split size on the host, so it can be
    captured in a CUDA graph (NCCL) as long as every rank passes the same shape. Also how the exact-split
    dispatch exchanges its counts ([size, m]: row d what this rank sends rank d -> row s what rank s sends here)
    before `all_to_all`."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def broadcast(x: torch.Tensor, ctx: ParallelContext, src_rank: int = 0, axis: str = "tp") -> torch.Tensor:
    """Copy rank `src_rank`'s `x` (group-local rank) to every rank of `axis`."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    dist.broadcast(x, src=dist.get_global_rank(group, src_rank), group=group)
    return x


def barrier(ctx: ParallelContext, axis: str = "world") -> None:
    size, group = _group(ctx, axis)
    if size == 1:
        return
    import torch.distributed as dist

    dist.barrier(group=group)


def dp_token_counts(num_tokens: int, ctx: ParallelContext, device: torch.device | str = "cpu") -> list[int]:
    """Each dp rank's token count this step (every tp rank of a dp rank runs the same batch). The worker side
    uses it to skip a step only when every dp rank is idle; otherwise idle ranks run an empty batch."""
    return all_gather_counts(num_tokens, ctx, "dp", device)


__all__ = ["ParallelContext", "RankLayout", "MOE_DISPATCH_MODES", "init_parallel", "destroy_parallel",
           "all_reduce", "all_gather", "all_gather_counts", "all_gather_varlen", "all_to_all",
           "all_to_all_equal",
           "broadcast", "barrier", "dp_token_counts"]
