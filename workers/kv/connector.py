"""The scheduler side of KV transfer for one engine core: `KVConnector` (docs/disaggregation.md).

An engine (or each dp rank of one) has a core (`workers/core.py`) and a connector beside it; the connector writes
the KV commands of each step for its shards and moves the core's disaggregated requests on from their events:

- `PrefillConnector` (workers/kv/handoff.py): requests that hand their KV to a decode group after their first
  token: announce in the step, send in the next, free the pages once the transfer settled (or its lease ran out).
- `DecodeConnector` (workers/kv/remote.py): requests whose pages are reserved and whose KV comes from a prefill
  group: prepare the receive, start decoding once the KV landed and the first token is known, fail them when it
  cannot come.
- A unified engine's connector (this base class) has no agents and nothing to move.

The step calls, in order: `poll(core)` (leases; activate requests whose KV landed, from the last step's
results), `on_schedule(core)` (before the execute: announce), `take_commands()` (this step's `KVCommands`, which
ride the `StepBatch` to every shard), `on_finished(core, ...)` (each handed-off request), `after_step(core)`
(queue the sends), `on_events(core, events)` (the shards' `KVEvents` from the `StepResult`: settle transfers).
The connector never calls an agent per request: its shards' `KVWorker`s run the commands inside the step
(workers/kv/worker.py). Pair wiring (`pairs`, a `KVPairs`) is per pair and stays a control call.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.core import EngineCore, EngineCoreOutput
from workers.kv.commands import Announce, CommandError, KVCommands, KVEvents, Prepare, Send
from workers.kv.config import TransferConfig
from workers.kv.endpoint import TransferResult
from workers.kv.pairs import KVPairs
from workers.stats import TransferStats

if TYPE_CHECKING:
    from workers.scheduler import Sequence as Seq

_MAX_MARKS = 50_000  # about 6 marks per disaggregated request


class KVTransferFailed(RuntimeError):
    """A disaggregated request lost its KV on the way (transfer error, dead peer, lease expired)."""


def first_token_meta(token: int, logprobs: dict[int, float] | None) -> dict:
    """The prefill's first token as it rides in the KV header (JSON: logprobs as [id, value] pairs, so ids stay
    ints; floats survive JSON exactly)."""
    return {"first": int(token), "logprobs": None if logprobs is None else [[int(k), v] for k, v in logprobs.items()]}


def first_token_from_meta(meta: dict) -> tuple[int, dict[int, float] | None] | None:
    """(token, logprobs) from a KV header's meta; None when it carries no first token."""
    if "first" not in meta:
        return None
    lp = meta.get("logprobs")
    return int(meta["first"]), None if lp is None else {int(k): float(v) for k, v in lp}


def suppress():
    return contextlib.suppress(Exception)


@dataclass(eq=False)
class _Outbox:
    """Commands queued for the next step (workers/kv/commands.py)."""

    abort: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    prepare: list[Prepare] = field(default_factory=list)
    announce: list[Announce] = field(default_factory=list)
    send: list[Send] = field(default_factory=list)

    def changes(self) -> bool:
        return bool(self.abort or self.release or self.prepare or self.announce or self.send)

    def take(self, watch: Sequence[str]) -> KVCommands:
        cmds = KVCommands(abort=tuple(dict.fromkeys(self.abort)), release=tuple(dict.fromkeys(self.release)),
                          prepare=tuple(self.prepare), announce=tuple(self.announce), send=tuple(self.send),
                          watch=tuple(watch))
        self.abort, self.release, self.prepare, self.announce, self.send = [], [], [], [], []
        return cmds


class KVConnector:
    """A unified engine's connector (no transfers), and what both ends share: agents, pairs, marks, stats."""

    def __init__(self, agents: Sequence = (), *, role: str = "unified",
                 config: TransferConfig | None = None) -> None:
        self.agents = list(agents)  # one per engine (a worker group's spans its shards): pair calls only
        self.pairs = KVPairs(self.agents)
        self.role = role
        self.config = config or TransferConfig()
        # handoff marks of disaggregated requests for `AsyncEngine.debug_timeline` (bounded; step thread only)
        self.marks: deque[tuple] = deque(maxlen=_MAX_MARKS)
        self._transfer_stats: list[TransferStats] = []
        self._out = _Outbox()  # commands for the next step
        self._results: dict[str, TransferResult] = {}  # the latest step's result of each watched transfer
        self._errors: dict[str, CommandError] = {}  # commands a shard could not run, by transfer id
        self._records: dict[str, list[TransferStats]] = {}  # per-pair stats records by transfer id

    # ---- the step (no-ops without transfers) ------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        """Whether a transfer of this request is still open here (its abort must reach this connector)."""
        return False

    def request_ids(self) -> list[str]:
        return []

    def has_pending(self) -> bool:
        """Requests waiting on a KV transfer (or its lease) rather than on a step."""
        return False

    def poll(self, core: EngineCore) -> tuple[list[EngineCoreOutput], list[str]]:
        """Move transfers on (non-blocking): (outputs of requests that start decoding now, ids of requests the
        core no longer holds because their transfer ended them)."""
        return [], []

    def abort(self, core: EngineCore, request_id: str) -> bool | None:
        """Abort the request's transfer side; True/False when that settles the abort, None to leave it to the
        core."""
        return None

    def on_schedule(self, core: EngineCore) -> None:
        """The core scheduled a step (before its execute)."""

    def on_finished(self, core: EngineCore, seq: Seq, first_logprobs: dict[int, float] | None) -> None:
        """A request of this connector finished on the core (after the text layer saw its tokens)."""

    def after_step(self, core: EngineCore) -> None:
        """The step's outputs are out (or the step failed)."""

    def on_step_failed(self, request_id: str, reason: str) -> None:
        """A failed step ended the request."""

    @property
    def num_awaiting_kv(self) -> int:
        return 0

    # ---- results and stats ------------------------------------------------------------------------------
    def pop_failures(self) -> list[tuple[str, str]]:
        return []

    def pop_transfer_outcomes(self) -> list[tuple[str, bool, str | None]]:
        return []

    def pop_transfer_stats(self) -> list[TransferStats]:
        out, self._transfer_stats = self._transfer_stats, []
        return out

    # ---- the step's KV commands and events ----------------------------------------------------------------
    def has_commands(self) -> bool:
        """Commands wait for a step (a KV-only step runs them when no batch does)."""
        return self._out.changes()

    def wants_step(self) -> bool:
        """Whether a step now would move a transfer on (commands queued, or a request ready to go on)."""
        return self.has_commands()

    def take_commands(self, *, watch: bool = True) -> KVCommands | None:
        """This step's `KVCommands` (None when there is nothing to run or watch); `watch` False: only run the
        queued commands (an admission's prepare), ask for no results."""
        cmds = self._out.take(self._watching() if watch else ())
        return cmds if cmds else None

    def _watching(self) -> tuple[str, ...]:
        """The transfers whose results this connector needs from the step."""
        return ()

    def absorb(self, events: KVEvents | None) -> None:
        """Keep a step's KV events: the watched results (replacing the last step's), command errors, stats."""
        if events is None:
            return
        self._results = dict(events.results)
        self._errors.update(events.errors)
        for s in events.stats:
            self._records.setdefault(s.request_id, []).append(s)

    def on_events(self, core: EngineCore, events: KVEvents | None) -> tuple[list[EngineCoreOutput], list[str]]:
        """The step's events are in: keep them and move transfers on (`poll`)."""
        self.absorb(events)
        return self.poll(core) if events is not None else ([], [])

    def _abort(self, transfer_id: str) -> None:
        self._out.abort.append(transfer_id)

    def _release(self, transfer_id: str) -> None:
        """Let the shards forget a settled transfer; its stats records become one (bytes summed over the shards'
        pairs, seconds the slowest), a prefill's kept for `pop_transfer_stats`."""
        self._out.release.append(transfer_id)
        self._results.pop(transfer_id, None)
        self._errors.pop(transfer_id, None)
        records = self._records.pop(transfer_id, [])
        if records and self.role == "prefill":  # one record per transfer: the sender's (the receiver's is the same)
            self._transfer_stats.append(TransferStats(
                request_id=transfer_id, num_bytes=sum(r.num_bytes for r in records),
                seconds=max(r.seconds for r in records), num_pages=max(r.num_pages for r in records),
                ok=all(r.ok for r in records)))

    def add_listener(self, fn) -> None:
        """`fn()` is called (from a transfer thread) whenever a transfer of this connector settles (in-process
        agents only: a worker group's engine hears of it from its next step)."""
        for agent in self.agents:
            agent.add_listener(fn)

    def mark(self, kind: str, request_id: str, phases: Mapping[str, float] | None = None) -> None:
        """Record a handoff event: (time.time(), kind, request id, the transfer's phase marks or None). Wall
        clock, so the prefill and decode replicas' marks and the benchmark client's times share one axis; the
        transfer's marks (time.monotonic()) are moved onto it here."""
        now = time.time()
        if phases:
            shift = now - time.monotonic()
            phases = {k: v + shift for k, v in phases.items()}
        self.marks.append((now, kind, request_id, phases or None))

    def shutdown(self) -> None:
        for agent in self.agents:
            with suppress():
                agent.close()
