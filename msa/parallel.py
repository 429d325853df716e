"""The explicit parallel context of one shard and every collective the model runs.

Nothing here is global: each layer receives a `ParallelContext` when it is built and passes it to the
collectives below. With a group size of 1 every collective is a no-op, so the single-shard model pays nothing.

Axes:
  tp: tensor parallel (attention heads, MLP columns/rows, vocab);
  ep: expert parallel (MoE experts split by expert id);
  dp: attention data parallel (each dp rank runs attention for its own requests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """This shard's position on each parallel axis; groups are torch.distributed process groups or None."""

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    dp_group: Any = None

    def __post_init__(self) -> None:
        for axis in ("tp", "ep", "dp"):
            size, rank = getattr(self, f"{axis}_size"), getattr(self, f"{axis}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{axis}_rank: {rank} is not a rank of a group of size {size}")
            if size > 1 and getattr(self, f"{axis}_group") is None:
                raise ValueError(f"{axis}_group: a process group is required when {axis}_size = {size} > 1")

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


def _group(ctx: ParallelContext, axis: str) -> tuple[int, Any]:
    if axis not in ("tp", "ep", "dp"):
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
    """Concatenate every rank's `x` along `dim` in rank order."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, ctx: ParallelContext, src_rank: int = 0, axis: str = "tp") -> torch.Tensor:
    """Copy rank `src_rank`'s `x` (group-local rank) to every rank of `axis`."""
    size, group = _group(ctx, axis)
    if size == 1:
        return x
    import torch.distributed as dist

    dist.broadcast(x, src=dist.get_global_rank(group, src_rank), group=group)
    return x


__all__ = ["ParallelContext", "all_reduce", "all_gather", "broadcast"]
