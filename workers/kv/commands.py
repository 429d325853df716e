"""What a step carries for KV transfer: `KVCommands` in the `StepBatch`, `KVEvents` back in the `StepResult`.

The scheduler side (`KVConnector`, workers/kv/connector.py) writes one `KVCommands` per step: what every shard
of the engine (or dp rank) runs before the step's forward (release, prepare a receive, announce headers, send
pages, abort), and which transfers it wants to hear about. Each shard's worker side (`KVWorker`,
workers/kv/worker.py) runs them on its own `TransferAgent` and answers with `KVEvents`: the watched transfers'
results after the forward and the stats records settled since the last step. A worker group's answers are folded
into one per dp rank (`combine_events`), so the connector reads one result per transfer, as the core reads one
token per row. Plain values only: they pickle with the batch to shard actors.

Page ids of a send are those of pages written by an earlier step (a request's first token is known only after its
step's update), so every command may run before the forward; an announced header goes out before the forward
that writes its last pages, which is what announcing is for.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.kv.endpoint import TransferResult
    from workers.stats import TransferStats


@dataclass(frozen=True, slots=True)
class Prepare:
    """Decode: expect `transfer_id`'s KV from prefill group `group` into `page_ids`."""

    transfer_id: str
    page_ids: tuple[int, ...]
    group: str


@dataclass(frozen=True, slots=True)
class Announce:
    """Prefill: send these requests' headers (transfer id, page ids) to `group` now; a `Send` follows each."""

    group: str
    items: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class Send:
    """Prefill: send requests' pages (transfer id, page ids, meta) to `group` as one payload per pair;
    `withdrawn`: announced requests that are not sent after all."""

    group: str
    items: tuple[tuple[str, tuple[int, ...], dict | None], ...]
    withdrawn: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KVCommands:
    """One step's KV work for every shard of an engine (or dp rank), run in field order before the forward;
    `watch`: the transfers whose results come back in the step's `KVEvents`."""

    release: tuple[str, ...] = ()
    prepare: tuple[Prepare, ...] = ()
    announce: tuple[Announce, ...] = ()
    send: tuple[Send, ...] = ()
    abort: tuple[str, ...] = ()  # last: a request aborted right after its prepare or send was queued
    watch: tuple[str, ...] = ()
    # False (set by an executor): a KV-only step of the whole engine, so no shard runs even the empty forward a
    # lockstep dp group runs for an idle rank (no rank computes: no collective to match)
    forward: bool = True

    def __bool__(self) -> bool:
        return bool(self.abort or self.release or self.prepare or self.announce or self.send or self.watch)

    @property
    def changes(self) -> bool:
        """Whether running these changes a transfer (else they only ask for results)."""
        return bool(self.abort or self.release or self.prepare or self.announce or self.send)


@dataclass(frozen=True, slots=True)
class CommandError:
    """A command a shard could not run for a transfer: the error's class name (`UnwiredGroupError`: the group has
    no pairs there, retryable) and its message. The transfer reads FAILED and settled on that shard."""

    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class KVEvents:
    """A shard's (or, combined, a tp group's) answer to a step's `KVCommands`."""

    results: dict[str, TransferResult] = field(default_factory=dict)  # per watched transfer id
    errors: dict[str, CommandError] = field(default_factory=dict)  # per transfer id whose command failed
    stats: tuple[TransferStats, ...] = ()  # one record per pair operation settled since the last step


def combine_events(parts: Sequence[KVEvents | None]) -> KVEvents | None:
    """The shards of one tp group answer as one: each transfer's results combined (`TransferAgent.combine`:
    DONE only when every shard is, FAILED if any is), every error and stats record kept."""
    parts = [p for p in parts if p is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    from workers.kv.agent import TransferAgent  # the agent module holds the combine rule (and torch)

    ids = [tid for tid in parts[0].results]
    results = {tid: TransferAgent.combine(tid, [p.results[tid] for p in parts if tid in p.results]) for tid in ids}
    errors: dict[str, CommandError] = {}
    for p in parts:
        for tid, err in p.errors.items():
            errors.setdefault(tid, err)
    return KVEvents(results=results, errors=errors, stats=tuple(s for p in parts for s in p.stats))
