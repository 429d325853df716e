"""The scheduler side of KV transfer for one engine core: `KVConnector` (docs/disaggregation.md).

An engine (or each dp rank of one) has a core (`workers/core.py`) and a connector beside it; the connector drives
its shards' transfer agents and moves the core's disaggregated requests on:

- `PrefillConnector` (workers/kv/handoff.py): requests that hand their KV to a decode group after their first
  token: announce before the step, send after it, free the pages once the transfer settled (or its lease ran out).
- `DecodeConnector` (workers/kv/remote.py): requests whose pages are reserved and whose KV comes from a prefill
  group: prepare the receive, start decoding once the KV landed and the first token is known, fail them when it
  cannot come.
- A unified engine's connector (this base class) has no agents and nothing to move.

The step calls, in order: `poll(core)` (settle transfers, activate landed requests), `on_schedule(core)` (before
the execute), `on_finished(core, ...)` (each handed-off request), `after_step(core)` (send). Pair wiring
(`kv_listen`, `kv_connect`, ...) is common to both ends. This is the first cut of the connector: its worker side
still goes through per-request agent calls (issue 19 moves those into the step).
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from workers.core import EngineCore, EngineCoreOutput
from workers.kv.agent import TransferAgent
from workers.kv.config import TransferConfig
from workers.kv.endpoint import TransferResult
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


class KVConnector:
    """A unified engine's connector (no transfers), and what both ends share: agents, pairs, marks, stats."""

    def __init__(self, agents: Sequence = (), *, role: str = "unified",
                 config: TransferConfig | None = None) -> None:
        self.agents = list(agents)  # one per engine (a worker group's spans its shards)
        self.role = role
        self.config = config or TransferConfig()
        # handoff marks of disaggregated requests for `AsyncEngine.debug_timeline` (bounded; step thread only)
        self.marks: deque[tuple] = deque(maxlen=_MAX_MARKS)
        # decode: prefill group -> its per-prefill-dp-rank sub-groups (a prefill with attention DP, kv_listen)
        self._split: dict[str, list[str]] = {}
        # the remote groups this engine has pairs with, by every name a request may give (a group and its dp
        # sub-groups): the replica answers "not wired" before it starts a request that names another (its peer
        # restarted and the router has not re-wired it yet), instead of failing it half way
        self._wired: dict[str, set[str]] = {}
        self._transfer_stats: list[TransferStats] = []

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

    def _collect_stats(self) -> None:
        for agent in self.agents:
            stats = agent.pop_stats()
            if self.role == "prefill":  # one record per transfer: the sender's (the receiver's is the same bytes)
                self._transfer_stats.extend(stats)

    def _combined(self, transfer_ids: list[str]) -> dict[str, TransferResult]:
        """Each request's transfer over every shard of this group: one `results` call per agent for all of
        them (a worker group's agent answers them in one round trip per shard)."""
        if not transfer_ids:
            return {}
        per_agent = [agent.results(transfer_ids) for agent in self.agents]
        return {tid: TransferAgent.combine(tid, [res[i] for res in per_agent])
                for i, tid in enumerate(transfer_ids)}

    def add_listener(self, fn) -> None:
        """`fn()` is called (from a transfer thread) whenever a transfer of this connector settles."""
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

    # ---- pairs (each shard's agent takes the routes of its tp rank; the lists cover every shard) -------------
    def kv_listen(self, group: str, remote_tp: int, remote_dp: int = 1) -> list:
        """Decode role: open the pairs from prefill group `group` (tp `remote_tp`); returns what its shards
        `kv_connect` to: [(route as a dict, (host, port))].

        A prefill group with attention DP (`remote_dp` > 1) sends each request from the shards of the dp rank
        that ran it, so each of its dp ranks needs pairs of its own: they are opened under the sub-group
        `TransferAgent.dp_group(group, q)` and each entry is tagged "src_dp": q (the prefill engine hands dp
        rank q its entries). A request that prefill dp rank q computes is admitted under that sub-group;
        `kv_drop`, `kv_broken` and `kv_wait_ready` of `group` cover all of them."""
        if remote_dp == 1:
            out = [x for agent in self.agents for x in agent.listen(group, remote_tp)]
            self._wired[group] = {group}
            return out
        self.kv_drop(group)  # a previous listen of this name (split or not)
        subs = [TransferAgent.dp_group(group, q) for q in range(remote_dp)]
        self._split[group] = subs
        out = [({**route, "src_dp": q}, address) for q, sub in enumerate(subs) for agent in self.agents
               for route, address in agent.listen(sub, remote_tp)]
        self._wired[group] = {group, *subs}
        return out

    def _family(self, group: str) -> list[str]:
        """The pair groups behind the name `group`: its prefill-dp sub-groups when split, else itself."""
        return self._split.get(group, [group])

    def kv_connect(self, group: str, listened: list) -> None:
        """Prefill role: join the pairs decode group `group` listens on (returns at once; see kv_wait_ready)."""
        tagged = sorted({route["src_dp"] for route, _address in listened if "src_dp" in route})
        if tagged:  # the decode side opened pairs per prefill dp rank: a DPEngine hands each rank its own
            raise ValueError(f"listened: pairs for prefill dp ranks {tagged}, but this prefill engine has dp=1 "
                             f"(the decode side must listen with remote_dp=1)")
        for agent in self.agents:
            agent.connect(group, listened)
        dps = {int(route["dp"]) for route, _address in listened if "dp" in route}
        self._wired[group] = {group, *(TransferAgent.dp_group(group, d) for d in dps)}

    def kv_wired(self, group: str) -> bool:
        """Whether this engine has pairs with `group` (by its name or a dp sub-group's); a replica that
        restarted has none until the router wires it again. Reads a dict only: safe off the step thread."""
        return any(group in names for names in list(self._wired.values()))

    def kv_wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        for g in [None] if group is None else self._family(group):
            for agent in self.agents:
                agent.wait_ready(timeout_s, g)

    def kv_drop(self, group: str) -> None:
        self._wired.pop(group, None)
        for g in self._split.pop(group, [group]):
            for agent in self.agents:
                agent.drop(g)

    def kv_broken(self, group: str) -> str | None:
        return next((why for g in self._family(group) for agent in self.agents if (why := agent.broken(g))), None)

