"""The worker side of KV transfer: `KVWorker`, on each shard, runs a step's `KVCommands` on the shard's agent.

A shard (`ShardWorker`, or the in-process `LocalExecutor`) owns one `TransferAgent` over its own KV pages and a
`KVWorker` over it; `run_step` wraps the shard's forward: the commands before it (they touch only pages written by
earlier steps, or announce headers of pages this forward writes), the events after it. A command that fails for
a transfer (no pairs to its group, a duplicate id) is not the step's error: that transfer reads FAILED and settled
on this shard until the connector releases it, with the error in `KVEvents.errors`.
"""
from __future__ import annotations

from collections.abc import Callable

from workers.kv.agent import TransferAgent
from workers.kv.commands import CommandError, KVCommands, KVEvents
from workers.kv.config import TransferState
from workers.kv.endpoint import TransferResult


class KVWorker:
    """Runs `KVCommands` on one shard's `TransferAgent` and reports `KVEvents`."""

    def __init__(self, agent: TransferAgent) -> None:
        self.agent = agent
        self._failed: dict[str, CommandError] = {}  # transfer id -> why its command failed here (until release)
        self.in_step = False  # True while `run_step` runs (tests check no agent call happens outside a step)

    def run(self, cmds: KVCommands) -> dict[str, CommandError]:
        """Run the commands (before the forward); returns the errors of this step's commands."""
        errors: dict[str, CommandError] = {}
        for tid in cmds.release:
            self._failed.pop(tid, None)
            try:
                self.agent.release(tid)
            except (KeyError, RuntimeError):
                pass  # unknown here (its command failed), or not settled: the connector releases settled ones
        for p in cmds.prepare:
            self._attempt(errors, [p.transfer_id], lambda p=p: self.agent.prepare(p.transfer_id, p.page_ids, p.group))
        for a in cmds.announce:
            # a group without pairs here: nothing went ahead, and the `Send` that follows reports it
            self._attempt({}, [], lambda a=a: self.agent.announce(a.items, a.group))
        for s in cmds.send:
            ids = [tid for tid, _ids, _meta in s.items] + list(s.withdrawn)
            self._attempt(errors, ids, lambda s=s: self.agent.send_many(s.items, s.group, withdrawn=s.withdrawn))
        for tid in cmds.abort:
            self.agent.abort(tid)  # an unknown id is settled: nothing to abort
        self._failed.update(errors)
        return errors

    def _attempt(self, errors: dict[str, CommandError], ids: list[str], fn: Callable[[], None]) -> None:
        try:
            fn()
        except ValueError as e:
            for tid in ids:
                errors[tid] = CommandError(type(e).__name__, str(e))

    def report(self, cmds: KVCommands, errors: dict[str, CommandError]) -> KVEvents:
        """The watched transfers' results (after the forward), then the stats records settled so far (popped
        after the results: a transfer seen settled has its records in this answer)."""
        results = {tid: self._result(tid) for tid in cmds.watch}
        return KVEvents(results=results, errors=errors, stats=tuple(self.agent.pop_stats()))

    def _result(self, tid: str) -> TransferResult:
        failed = self._failed.get(tid)
        if failed is not None:
            return TransferResult(request_id=tid, state=TransferState.FAILED, settled=True, reason=failed.message)
        try:
            return self.agent.result(tid)
        except KeyError:  # released, or never started here
            return TransferResult(request_id=tid, state=TransferState.FAILED, settled=True, reason="unknown")

    def run_step(self, batch, execute: Callable):
        """`execute(batch)` (the shard's forward, a `StepResult`) with the batch's KV commands around it; the
        result carries the events (`StepResult.kv`). A shard that returns no result (not a sampling tp rank)
        returns a bare one carrying its events."""
        cmds = getattr(batch, "kv", None)
        if cmds is None:
            return execute(batch)
        self.in_step = True
        try:
            errors = self.run(cmds)
            result = execute(batch) if batch.chunks or cmds.forward else None
            events = self.report(cmds, errors)
        finally:
            self.in_step = False
        return with_events(result, events)


def with_events(result, events: KVEvents):
    """`result` (a `StepResult`, or None from a rank that does not sample) carrying `events`."""
    import dataclasses

    from workers.runner import StepResult

    if result is None:
        result = StepResult(token_ids=[], logprobs=[], forward_time=0.0, sample_time=0.0, prompt_logprobs=[])
    return dataclasses.replace(result, kv=events)
