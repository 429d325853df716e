"""Parallel linear layers and the weight loaders that narrow checkpoint tensors to one shard's slice.

Every parameter carries `param.weight_loader(param, source, shard_id=None)`. `source` is either a torch tensor
or a safetensors slice (`safe_open(...).get_slice(key)`); both are indexed with a tuple of slices, so a loader
reads only this rank's rows/columns from disk and no rank ever materialises a full tensor it does not hold.
`param.shard_ids` lists the shard ids the loader accepts besides None (None = the whole / packed tensor).
With one shard every layer here is a plain linear (no collective runs).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from msa.parallel import ParallelContext, all_gather, all_reduce

WeightSource = Any  # torch.Tensor or a safetensors PySafeSlice


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


def source_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def check_shape(src: WeightSource, expected: Sequence[int], what: str = "tensor") -> None:
    got = source_shape(src)
    if got != tuple(expected):
        raise WeightShapeError(f"shape {list(got)} does not match the expected {list(expected)} ({what})")


def read(src: WeightSource, index: tuple[slice, ...]) -> torch.Tensor:
    """Read `src[index]` (only that region is read from disk for a safetensors slice)."""
    out = src[index]
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def new_param(shape: Sequence[int], dtype: torch.dtype, device: Any, loader: Callable, shard_ids=()) -> nn.Parameter:
    """An uninitialised inference parameter with its weight loader attached."""
    p = nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    p.shard_ids = tuple(shard_ids)
    return p


def replicated_loader(param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
    """Every rank holds the whole tensor (norm weights, router, index-K projection)."""
    if shard_id is not None:
        raise WeightShapeError(f"shard {shard_id!r} given for a replicated parameter")
    check_shape(src, param.shape, "replicated")
    param.data.copy_(read(src, tuple(slice(None) for _ in param.shape)))


@dataclass(frozen=True)
class RowPart:
    """One logical output block of a row-sharded weight: `full` rows in the checkpoint tensor, of which this
    rank holds rows [start, start + length) at local rows [local_offset, local_offset + length)."""

    name: Any
    full: int
    start: int
    length: int
    local_offset: int


class PartitionedLinear(nn.Module):
    """y = x W^T where W's output rows are the concatenation of `parts`, each sliced for this rank.

    The checkpoint may hold the parts separately (shard_id = part name) or packed in order (shard_id None).
    """

    def __init__(self, input_size: int, parts: list[tuple[Any, int, int, int]], *, dtype, device):
        super().__init__()
        self.input_size = input_size
        self.parts: list[RowPart] = []
        off = 0
        for name, full, start, length in parts:
            self.parts.append(RowPart(name, full, start, length, off))
            off += length
        self.output_size_local = off
        names = [p.name for p in self.parts] if len(self.parts) > 1 else []
        self.weight = new_param((off, input_size), dtype, device, self._load, names)

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        if shard_id is None:
            check_shape(src, (sum(p.full for p in self.parts), self.input_size), "packed rows")
            base = 0
            for p in self.parts:
                self._copy_part(param, src, p, base)
                base += p.full
            return
        part = next((p for p in self.parts if p.name == shard_id), None)
        if part is None:
            raise WeightShapeError(f"unknown shard {shard_id!r}")
        check_shape(src, (part.full, self.input_size), f"shard {shard_id!r}")
        self._copy_part(param, src, part, 0)

    @staticmethod
    def _copy_part(param: nn.Parameter, src: WeightSource, p: RowPart, base: int) -> None:
        rows = read(src, (slice(base + p.start, base + p.start + p.length), slice(None)))
        param.data[p.local_offset:p.local_offset + p.length].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ReplicatedLinear(PartitionedLinear):
    """Every rank holds the whole weight [out, in]."""

    def __init__(self, input_size: int, output_size: int, *, dtype, device):
        super().__init__(input_size, [(None, output_size, 0, output_size)], dtype=dtype, device=device)


class ColumnParallelLinear(PartitionedLinear):
    """Output dimension split over tp; `output_sizes` lists logical parts (e.g. [gate, up]) that are each split
    separately, so a rank's slice holds its share of every part (shard ids 0, 1, ...)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], ctx: ParallelContext, *, dtype, device,
                 gather_output: bool = False):
        parts = []
        for i, size in enumerate(output_sizes):
            start, length = ctx.split(size, f"output part {i}")
            parts.append((i, size, start, length))
        super().__init__(input_size, parts, dtype=dtype, device=device)
        self.ctx = ctx
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_gather(y, self.ctx, dim=-1) if self.gather_output else y


class QKVParallelLinear(PartitionedLinear):
    """Fused q, k, v projection (shard ids "q", "k", "v"). q heads split over tp; KV heads split too, or
    replicated when tp exceeds the KV head count, so each rank holds the KV heads of its own q heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, ctx: ParallelContext,
                 *, dtype, device):
        q0, nq = ctx.split(num_heads, "num_attention_heads")
        kv0, nkv = ctx.kv_head_range(num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, head_dim
        super().__init__(hidden_size, [
            ("q", num_heads * head_dim, q0 * head_dim, nq * head_dim),
            ("k", num_kv_heads * head_dim, kv0 * head_dim, nkv * head_dim),
            ("v", num_kv_heads * head_dim, kv0 * head_dim, nkv * head_dim),
        ], dtype=dtype, device=device)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (nq + 2 nkv) * D] -> q [T, nq, D], k [T, nkv, D], v [T, nkv, D] (local heads)."""
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        return q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d), v.reshape(-1, self.num_kv_heads, d)


class KVHeadParallelLinear(PartitionedLinear):
    """A per-head projection whose heads follow the KV heads' sharding (the indexer's q heads: one per KV group)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, ctx: ParallelContext, *, dtype, device):
        h0, nh = ctx.kv_head_range(num_heads)
        self.num_heads, self.head_dim = nh, head_dim
        super().__init__(hidden_size, [(None, num_heads * head_dim, h0 * head_dim, nh * head_dim)],
                         dtype=dtype, device=device)


class RowParallelLinear(nn.Module):
    """Input dimension split over tp; partial products are summed with an all-reduce (unless reduce=False,
    for a caller that fuses several partial sums into one all-reduce)."""

    def __init__(self, input_size: int, output_size: int, ctx: ParallelContext, *, dtype, device,
                 reduce: bool = True):
        super().__init__()
        self.ctx, self.reduce = ctx, reduce
        self.input_size, self.output_size = input_size, output_size
        self.start, self.length = ctx.split(input_size, "row-parallel input")
        self.weight = new_param((output_size, self.length), dtype, device, self._load)

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        if shard_id is not None:
            raise WeightShapeError(f"shard {shard_id!r} given for a row-parallel weight")
        check_shape(src, (self.output_size, self.input_size), "row-parallel")
        param.data.copy_(read(src, (slice(None), slice(self.start, self.start + self.length))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y, self.ctx) if self.reduce else y


def _vocab_range(vocab_size: int, ctx: ParallelContext) -> tuple[int, int, int]:
    """(first id, ids held, rows per rank) of this rank's vocab slice; the last rank's slice may be short."""
    per = -(-vocab_size // ctx.tp_size)
    start = min(ctx.tp_rank * per, vocab_size)
    return start, min(per, vocab_size - start), per


class _VocabSharded(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        self.ctx, self.vocab_size, self.hidden_size = ctx, vocab_size, hidden_size
        self.start, self.count, self.per = _vocab_range(vocab_size, ctx)
        self.weight = new_param((self.per, hidden_size), dtype, device, self._load)

    def _load(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        if shard_id is not None:
            raise WeightShapeError(f"shard {shard_id!r} given for a vocab-parallel weight")
        check_shape(src, (self.vocab_size, self.hidden_size), "vocab-parallel")
        param.data[self.count:].zero_()  # padding rows of the last rank
        if self.count:
            param.data[:self.count].copy_(read(src, (slice(self.start, self.start + self.count), slice(None))))


class VocabParallelEmbedding(_VocabSharded):
    """Token embedding with the vocabulary split over tp; each rank embeds the ids it holds, then all-reduce."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return all_reduce(out, self.ctx)


class ParallelLMHead(_VocabSharded):
    """Untied output projection with the vocabulary split over tp; logits are gathered to [N, vocab]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.ctx.tp_size > 1:
            logits = all_gather(logits, self.ctx, dim=-1)
        return logits[:, :self.vocab_size]


__all__ = ["WeightShapeError", "WeightSource", "source_shape", "check_shape", "read", "new_param",
           "replicated_loader", "PartitionedLinear", "ReplicatedLinear", "ColumnParallelLinear",
           "QKVParallelLinear", "KVHeadParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "ParallelLMHead"]
