"""Which shard sends which KV heads to which shard (pure): `plan_routes` over two tp layouts."""
from __future__ import annotations

from dataclasses import dataclass


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) tp rank `rank` holds; the same split as msa.parallel.ParallelContext.kv_head_range
    (heads are replicated on tp / num_kv_heads consecutive ranks when tp > num_kv_heads)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank: {rank} is not a rank of tp={tp}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads: {num_kv_heads} does not split over tp={tp}")
        per = num_kv_heads // tp
        return rank * per, per
    if tp % num_kv_heads:
        raise ValueError(f"tp: {tp} must be a multiple of num_key_value_heads={num_kv_heads} to replicate")
    return rank // (tp // num_kv_heads), 1


@dataclass(frozen=True, kw_only=True)
class Route:
    """Sender tp rank `src` sends global KV heads [head_start, head_end) (and the index-K pages when
    `with_index`) to receiver tp rank `dst`."""

    src: int
    dst: int
    head_start: int
    head_end: int
    with_index: bool

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def plan_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[Route]:
    """Every receiver rank gets each of its KV heads from exactly one sender rank, and the index-K from exactly
    one (its first route). A head replicated on several sender ranks is taken from replica `dst % replicas`, so
    equal layouts map rank i -> rank i and no sender is picked for everything. Sorted by (dst, head_start)."""
    owners: list[list[int]] = [[] for _ in range(num_kv_heads)]
    for s in range(src_tp):
        first, count = kv_heads_of_rank(num_kv_heads, src_tp, s)
        for h in range(first, first + count):
            owners[h].append(s)
    routes: list[Route] = []
    for d in range(dst_tp):
        first, count = kv_heads_of_rank(num_kv_heads, dst_tp, d)
        picks = [(h, owners[h][d % len(owners[h])]) for h in range(first, first + count)]
        start = 0
        for i in range(1, len(picks) + 1):  # merge runs of consecutive heads taken from the same sender
            if i == len(picks) or picks[i][1] != picks[start][1]:
                routes.append(Route(src=picks[start][1], dst=d, head_start=picks[start][0],
                                    head_end=picks[i - 1][0] + 1, with_index=start == 0))
                start = i
    return routes
