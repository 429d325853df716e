"""The disaggregation surface of the engine API: `EngineKV`, a mixin of `EngineAPI` (docs/disaggregation.md).

Every rank (an engine core, or one per dp rank) has a `KVConnector` beside its core. The step (workers/engine_api.py)
asks each connector for its `KVCommands` and hands them to the executor inside the rank's `StepBatch`; the shards
run them around the forward and answer with `KVEvents` in the `StepResult`, which go back to the connector.
When no batch runs but transfers are pending, the rank gets a KV-only step (a `StepBatch` with no rows: the shards
run the commands and report, the forward is skipped). Nothing here calls a transfer agent per request; pair
wiring (`kv_listen` ... on `Engine` / `DPEngine`) goes to the connectors' `pairs`.

What it needs of the class it is mixed into: `ranks`, `role`, `output`, `_parked`, `_rank_of`, `_deliver` and
`_execute` (EngineAPI).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from workers.batch import StepBatch
from workers.kv.commands import KVEvents
from workers.kv.connector import KVConnector
from workers.request import RequestOutput, SamplingParams
from workers.stats import TransferStats


class EngineKV:
    """Disaggregated requests over the engine's ranks: handoffs (prefill), remote requests (decode), the KV
    commands and events of each step, transfer outcomes and stats."""

    @property
    def connectors(self) -> list[KVConnector]:
        return [r.kv for r in self.ranks]

    @property
    def agents(self) -> list:
        """Every rank's transfer agents (pair calls and test checks only), in rank order."""
        return [a for r in self.ranks for a in r.kv.agents]

    def hands_off(self, request_id: str) -> bool:
        """Prefill role: whether `request_id` will send (or is sending) its KV to a decode group."""
        return self.role == "prefill" and any(r.kv.holds(request_id) for r in self.ranks)

    def has_pending_transfers(self) -> bool:
        """Requests waiting on a KV transfer (or its lease) rather than on a step."""
        return any(r.kv.has_pending() for r in self.ranks)

    # ---- the step's KV side -------------------------------------------------------------------------------
    def _with_kv(self, rank, batch: StepBatch | None, *, watch: bool = True) -> StepBatch | None:
        """`batch` carrying the rank's KV commands; a KV-only batch (no rows) when the core scheduled nothing
        and the connector has commands or transfers to watch; None when neither."""
        cmds = rank.kv.take_commands(watch=watch) if rank.kv.agents else None
        if cmds is None:
            return batch
        if batch is None:
            return StepBatch(input_ids=[], chunks=[], sample_chunks=[], rows=[], released_seq_ids=[], kv=cmds)
        return dataclasses.replace(batch, kv=cmds)

    def _kv_events(self, rank, events: KVEvents | None) -> list[RequestOutput]:
        """A step's KV events to the rank's connector: transfers settle, landed requests start decoding."""
        core_outputs, dropped = rank.kv.on_events(rank.core, events)
        for rid in dropped:
            self.output.drop(rid)
        return self._deliver(rank, core_outputs)

    def _kv_step(self, ranks: Sequence, *, watch: bool = True) -> list[RequestOutput]:
        """A KV-only step for `ranks` now (no forward): run their queued commands and, with `watch`, read the
        results back and move their requests on; without, keep only the events (an admission's prepare)."""
        batches = [self._with_kv(r, None, watch=watch) if r in ranks else None for r in self.ranks]
        if all(b is None for b in batches):
            return []
        results = self._execute(batches)
        outputs: list[RequestOutput] = []
        for rank, batch, result in zip(self.ranks, batches, results, strict=True):
            if batch is None or result is None:
                continue
            if watch:
                outputs += self._kv_events(rank, result.kv)
            else:
                rank.kv.absorb(result.kv)
        return outputs

    def _settle_now(self, rank) -> None:
        """An abort (or a failure) of a transfer goes out now, in a KV-only step, and its release in a second one
        once that step saw it settled: the pages are free when the call returns, as when nothing moves. The
        outputs those steps make wait for the next `step`."""
        for _ in range(2):
            if rank.kv.has_commands():
                self._parked += self._kv_step([rank])

    def _poll(self, rank) -> list[RequestOutput]:
        """Move the rank's transfers on from the latest results (pure: leases, activations)."""
        core_outputs, dropped = rank.kv.poll(rank.core)
        for rid in dropped:
            self.output.drop(rid)
        return self._deliver(rank, core_outputs)

    def poll_transfers(self) -> list[RequestOutput]:
        """Move disaggregated requests on now, through a KV-only step of every rank with transfers pending:
        free a prefill's pages once its transfer settled or its lease expired; start decoding a request whose
        KV landed and whose first token is known; fail one whose KV cannot come. Returns the outputs of
        requests that started decoding."""
        busy = [r for r in self.ranks if r.kv.has_pending() or r.kv.has_commands()]
        return [out for r in busy for out in self._poll(r)] + self._kv_step(busy)

    # ---- decode role ----------------------------------------------------------------------------------------
    def _admit_on(self, rank, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                  group: str, transfer_id: str | None, prompt: str | None, arrival_time: float | None,
                  first_from_kv: bool) -> list[int] | None:
        """Reserve the pages and post the receive on every shard before returning (a KV-only step: the prefill
        side may send as soon as this returns)."""
        if self.role != "decode":
            raise ValueError(f"role: only a decode engine admits remote prefills (this one is {self.role})")
        req = rank.kv.admit_remote(rank.core, request_id, prompt_token_ids, params, group=group,
                                   transfer_id=transfer_id, arrival_time=arrival_time, first_from_kv=first_from_kv)
        if req is None:
            return None
        self._kv_step([rank], watch=False)
        try:
            rank.kv.check_admitted(rank.core, request_id)
        except ValueError:
            self._kv_step([rank], watch=False)  # the shards that did prepare let go before the pages are reused
            raise
        self.output.add(req, prompt)
        return list(rank.core.pages.page_table(req.seqs[0].seq_id))

    def continue_remote(self, request_id: str, first_token: int,
                        first_logprobs: dict[int, float] | None = None) -> None:
        """Decode role: the first token (sampled by the prefill engine) of an admitted request; it decodes on
        once its KV has landed. A request already decoding (its first token came with the KV) goes on as it is."""
        rank = self._rank_of(request_id)
        if rank is None or self.role != "decode":
            raise KeyError(f"request_id: {request_id!r} is not awaiting its KV here (unknown, failed or aborted)")
        rank.kv.continue_remote(rank.core, request_id, first_token, first_logprobs)

    def fail_remote(self, request_id: str, why: str) -> bool:
        """Decode role: the request's KV will not come (its prefill reported the transfer failed): fail it now
        (its stream gets `KVTransferFailed(why)`) rather than at its lease. False when it is not awaiting its KV
        (unknown, landed already, or failed/aborted before)."""
        rank = self._rank_of(request_id)
        if rank is None or self.role != "decode":
            return False
        failed = rank.kv.fail_remote(rank.core, request_id, why)
        self._settle_now(rank)
        if not rank.core.holds(request_id):
            self.output.drop(request_id)
        return failed

    # ---- outcomes and stats ---------------------------------------------------------------------------------
    def pop_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of decode requests that failed for their KV since the last call."""
        return [x for r in self.ranks for x in r.kv.pop_failures()]

    def pop_transfer_outcomes(self) -> list[tuple[str, bool, str | None]]:
        """Prefill: (request id, ok, reason) of every handed-off request whose transfer settled."""
        return [x for r in self.ranks for x in r.kv.pop_transfer_outcomes()]

    def pop_transfer_stats(self) -> list[TransferStats]:
        return [x for r in self.ranks for x in r.kv.pop_transfer_stats()]

    def add_transfer_listener(self, fn) -> None:
        """`fn()` is called (from a transfer thread) whenever a transfer of this engine settles (in-process
        shards only; an engine over shard actors hears of it from its next step)."""
        for rank in self.ranks:
            rank.kv.add_listener(fn)

    def _shutdown_connectors(self) -> None:
        for rank in self.ranks:
            rank.kv.shutdown()
