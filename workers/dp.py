"""Attention data parallel: `DPEngine`, one engine core per dp rank around one worker group (docs/parallelism.md).

Composition, not threads: each dp rank is an `EngineCore` with its `KVConnector` (an `EngineAPI` rank), and a
step is the same three calls as `Engine`'s over all of them: every core schedules, one group execute runs every
dp rank's batch (`WorkerGroup.execute`), every core updates. A dp rank with nothing to do gets no batch; when its
MoE collectives span other dp ranks (`ep > tp`) its shards still run an empty forward so their peers never wait.
`make_engine(..., parallel=ParallelConfig(dp=2))` builds one.

New requests go to the least loaded dp rank. It serves every role: as decode a remote request is admitted on
one dp rank (its pages, its receiving shards); as prefill a request is placed on one dp rank first
(`place_request`), so the decode side prepares the receive from that dp rank's shards, which then send it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from workers.batch import StepBatch
from workers.config import EngineConfig, ParallelConfig
from workers.engine_api import EngineAPI, role_engine_config
from workers.executor.ray_group import GroupOptions, WorkerGroup
from workers.kv.config import TransferConfig
from workers.kv.group_agent import GroupTransferAgent
from workers.request import RequestOutput, SamplingParams
from workers.runner import StepResult


@dataclass(frozen=True, slots=True)
class _Placement:
    """Prefill role: a dp rank held for a request between `place_request` and `add_request`."""

    dp_rank: int
    when: float  # time.monotonic() of the placement: it is forgotten after the transfer lease
    num_tokens: int  # the prompt tokens it will prefill there (its load until it is added)


class DPEngine(EngineAPI):
    """An engine over dp attention-data-parallel ranks (see the module docstring); the `EngineAPI`."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig = EngineConfig(),
                 parallel: ParallelConfig = ParallelConfig(), device: str = "cpu", role: str = "unified",
                 executor=None, transfer: TransferConfig | None = None) -> None:
        if executor == "local":
            raise ValueError(f"executor: 'local' runs one shard in this process; dp={parallel.dp} needs a worker "
                             f"group ('auto' or 'ray')")
        options = executor if isinstance(executor, GroupOptions) else GroupOptions()
        self.parallel = parallel
        self._setup(model_dir, engine_config, role, transfer)
        self.group = WorkerGroup(model_dir, engine_config=role_engine_config(engine_config, role),
                                 parallel=parallel, device=device, options=options)
        self.executor = self.group
        try:
            for d in range(parallel.dp):
                self._add_rank({**self.group.rank_info[d * parallel.tp], "num_pages": self.group.num_pages},
                               self._agents_of(d))
        except BaseException:
            self.group.shutdown()
            raise
        # request id -> its dp rank, while in flight; prefill: request id -> its placement, not added yet. The
        # server places from its event loop while the step thread steps (through the step thread a placement
        # would wait out a whole prefill step), so both maps and their readers go under this lock.
        self._owner: dict[str, int] = {}
        self._placed: dict[str, _Placement] = {}
        self._load_lock = threading.Lock()

    def _agents_of(self, dp_rank: int) -> list:
        """A dp rank's disaggregation end: one agent over its tp group's shards (none for unified)."""
        if self.role not in ("prefill", "decode"):
            return []
        tp = self.parallel.tp
        actors = self.group.actors[dp_rank * tp:(dp_rank + 1) * tp]
        return [GroupTransferAgent(actors, role=self.role, num_kv_heads=self.model_config.num_key_value_heads,
                                   config=self.transfer_config)]

    def _execute(self, batches: list[StepBatch | None]) -> list[StepResult | None]:
        return self.group.execute(batches)

    # ---- requests ---------------------------------------------------------------------------------------
    def least_loaded_rank(self) -> int:
        """The least loaded dp rank: the fewest prompt tokens still to prefill (prefill role) or the fewest
        requests in flight (decode, unified), placed ones included; then the most free pages, then the lowest
        rank."""
        return self._ranks_by_load()[0]

    def _ranks_by_load(self) -> list[int]:
        # A prefill rank's step time grows with the prompt tokens it has to compute, so a 1,800-token prompt
        # weighs 360 five-token ones there. Decode and unified keep counting requests: a decoding request costs
        # one token per step whatever its prompt length (its pages are the tie-break), and a unified request
        # decodes for far longer than it prefills.
        load = self.pending_prefill_tokens() if self.role == "prefill" else self._requests_by_rank()
        return sorted(range(len(self.cores)), key=lambda d: (load[d], -self.cores[d].pages.num_free_pages, d))

    def _requests_by_rank(self) -> list[int]:
        load = [0] * len(self.cores)
        with self._load_lock:
            for d in (*self._owner.values(), *(p.dp_rank for p in self._placed.values())):
                load[d] += 1
        return load

    def pending_prefill_tokens(self) -> list[int]:
        """Per dp rank: the prompt tokens its requests have yet to compute, plus those of the requests placed
        there and not added yet (`place_request`'s `num_tokens`). Thread-safe, like `place_request`."""
        load = [0] * len(self.cores)
        with self._load_lock:
            for p in self._placed.values():
                load[p.dp_rank] += p.num_tokens
            # Read from another thread than the step thread: a dict `get` and two int attributes of the request's
            # first sequence are each atomic under the GIL (no iteration over the core's dicts, which the step
            # changes under us), and the sequence of an id in `_owner` exists (the core added it first). A count
            # one step old is fine for balancing.
            for rid, d in self._owner.items():
                req = self.cores[d].scheduler.requests.get(rid)
                if req is None:
                    # past its prompt: handed off (its KV travelling, no more compute here), finished or aborted
                    continue
                # Only sample 0 prefills the prompt (n > 1 samples fork from its pages and recompute at most a
                # page's tail); a preempted sequence is back at 0 computed tokens and weighs its whole prompt
                # again, a prefix-cache hit starts past the cached tokens; one decoding here weighs 0.
                seq = req.seqs[0]
                load[d] += max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
        return load

    def _set_owner(self, request_id: str, dp_rank: int | None) -> int | None:
        """Record (or with None drop) a request's dp rank; returns the one it had."""
        with self._load_lock:
            before = self._owner.pop(request_id, None)
            if dp_rank is not None:
                self._owner[request_id] = dp_rank
            return before

    def place_request(self, request_id: str, num_tokens: int | None = None) -> int:
        """Prefill role: choose the dp rank that will run `request_id`, a prompt of `num_tokens` tokens (the
        least loaded by prompt tokens still to prefill, `pending_prefill_tokens`), and hold it for
        `add_request`; until then the placement weighs `num_tokens` there (None: 1, for callers that do not
        say). The caller has the decode side prepare the receive from that dp rank's shards
        (`TransferAgent.dp_group(<this group's name>, rank)`) before adding the request.
        Thread-safe (the one call that may come from another thread than the one stepping). A placement that
        is neither added nor aborted within the transfer lease is forgotten (its router went away)."""
        if self.role != "prefill":
            raise ValueError(f"role: only a prefill engine places requests on a dp rank (this one is {self.role})")
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"num_tokens: a prompt has 0 or more tokens, got {num_tokens}")
        weight = 1 if num_tokens is None else num_tokens
        now = time.monotonic()
        with self._load_lock:
            if request_id in self._owner or request_id in self._placed:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            for rid, p in list(self._placed.items()):
                if now - p.when > self.transfer_config.lease_s:
                    del self._placed[rid]
        d = self._ranks_by_load()[0]
        with self._load_lock:
            self._placed[request_id] = _Placement(dp_rank=d, when=now, num_tokens=weight)
        return d

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None, handoff_to: str | None = None,
                    transfer_id: str | None = None) -> None:
        """On the placed dp rank (`place_request`), else the least loaded. A request handed off to a decode
        group must have been placed: the decode side prepared its receive for one dp rank's shards."""
        with self._load_lock:
            if request_id in self._owner:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            placed = self._placed.get(request_id)
        if handoff_to is not None and placed is None and self.role == "prefill":
            raise ValueError(f"handoff_to: a prefill engine with dp={len(self.cores)} hands off only requests "
                             f"placed first (place_request): the decode side prepares the receive from the "
                             f"shards of the dp rank that runs it")
        d = placed.dp_rank if placed is not None else self.least_loaded_rank()
        try:
            self._add_to(self.ranks[d], request_id, prompt_token_ids, params, prompt=prompt,
                         arrival_time=arrival_time, handoff_to=handoff_to, transfer_id=transfer_id)
        except BaseException:
            with self._load_lock:
                self._placed.pop(request_id, None)
            raise
        # The placement weighs until the core holds the request, then the owner does, in one step: a concurrent
        # `place_request` never finds the request in neither map (weightless) nor in both (counted twice).
        with self._load_lock:
            self._placed.pop(request_id, None)
            self._owner[request_id] = d

    def dp_rank_of(self, request_id: str) -> int | None:
        """The dp rank that holds the request (or has it placed)."""
        with self._load_lock:
            d = self._owner.get(request_id)
            placed = self._placed.get(request_id)
        return d if d is not None else placed.dp_rank if placed is not None else None

    def abort_request(self, request_id: str) -> bool:
        with self._load_lock:
            placed = self._placed.pop(request_id, None)
        d = self._set_owner(request_id, None)
        if d is None:
            return placed is not None  # placed and never added (its decode admission failed): nothing to free
        return super().abort_request(request_id)

    # ---- disaggregation: decode role ------------------------------------------------------------------------
    # Each dp rank is its own receiver: its tp group's shards listen for every prefill group, and a request
    # lands in the pages of the dp rank that admitted it. The prefill side sends it to that dp rank's
    # sub-group, `TransferAgent.dp_group(<this replica's group name>, dp_rank_of(request_id))`.
    def admit_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     group: str, transfer_id: str | None = None, prompt: str | None = None,
                     arrival_time: float | None = None, first_from_kv: bool = True) -> list[int] | None:
        """Reserve the prompt's pages on the least loaded dp rank with room (`dp_rank_of` says which); None
        when no dp rank has room now."""
        if self.role != "decode":
            raise ValueError(f"role: only a decode engine admits remote prefills (this one is {self.role})")
        if self.dp_rank_of(request_id) is not None:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        for d in self._ranks_by_load():
            pages = self._admit_on(self.ranks[d], request_id, prompt_token_ids, params, group=group,
                                   transfer_id=transfer_id, prompt=prompt, arrival_time=arrival_time,
                                   first_from_kv=first_from_kv)
            if pages is not None:
                self._set_owner(request_id, d)
                return pages
        return None

    def kv_listen(self, group: str, remote_tp: int, remote_dp: int = 1) -> list:
        """Open the pairs from prefill group `group` into every dp rank's shards; each entry is tagged with
        its dp rank (the prefill side makes one sub-group per dp rank of it). A prefill group with dp
        (`remote_dp` > 1) gets pairs per its own dp rank too (`Engine.kv_listen`): every (prefill dp rank,
        decode dp rank) meets."""
        return [({**route, "dp": d}, address) for d, kv in enumerate(self.connectors)
                for route, address in kv.pairs.listen(group, remote_tp, remote_dp)]

    # ---- disaggregation: prefill role -----------------------------------------------------------------------
    # Each dp rank sends the requests it ran from its own tp group's shards: the decode side listened once per
    # prefill dp rank (`kv_listen(..., remote_dp=dp)`, entries tagged "src_dp"), and each core joins the pairs
    # of its rank under the decode group's name, so `handoff_to` names the same decode group on every core.
    def kv_connect(self, group: str, listened: list) -> None:
        if self.role != "prefill":
            raise ValueError(f"role: only a prefill engine connects (this one is {self.role})")
        by_rank: dict[int | None, list] = {}
        for route, address in listened:
            fields = dict(route)
            by_rank.setdefault(fields.pop("src_dp", None), []).append((fields, address))
        if sorted(by_rank, key=str) != list(range(len(self.cores))):
            raise ValueError(f"listened: pairs for prefill dp ranks {sorted(by_rank, key=str)}, but this prefill "
                             f"engine has dp={len(self.cores)} (the decode side must listen with "
                             f"remote_dp={len(self.cores)})")
        for d, kv in enumerate(self.connectors):
            kv.pairs.connect(group, by_rank[d])

    def kv_wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        for kv in self.connectors:
            kv.pairs.wait_ready(timeout_s, group)

    def kv_drop(self, group: str) -> None:
        for kv in self.connectors:
            kv.pairs.drop(group)

    def kv_broken(self, group: str) -> str | None:
        return next((f"dp rank {d}: {why}" for d, kv in enumerate(self.connectors) if (why := kv.pairs.broken(group))),
                    None)

    def _forget_settled(self) -> None:
        """Drop the owner of requests no dp rank holds any more. A remote whose KV never came ends without an
        output (`pop_failures` reports it); a prefill's output is finished at its first token while its KV
        still travels, and its abort must still reach that dp rank until the transfer settled."""
        with self._load_lock:
            for rid, d in list(self._owner.items()):
                rank = self.ranks[d]
                if not rank.core.holds(rid) and not rank.kv.holds(rid):
                    del self._owner[rid]

    def abort_all(self) -> int:
        n = super().abort_all()
        with self._load_lock:
            self._owner.clear()
            self._placed.clear()
        return n

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        if self.role == "unified":
            for out in outputs:
                if out.finished:
                    self._set_owner(out.request_id, None)
        else:
            self._forget_settled()
        return outputs

    def shutdown(self) -> None:
        self._shutdown_connectors()
        self.group.shutdown()
