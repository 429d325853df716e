"""The engine replica's half of the ingress <-> engine stream (deploy/stream/__init__.py): an engine's cumulative
outputs turned into token deltas (`DeltaTracker`), one subscriber's not-yet-sent events (`Outbox`), and the
subscriptions this replica serves (`Publisher`). `EngineServer` (deploy/server.py, the Serve deployment) owns one
`Publisher` and maps the engine's refusals to `EngineError`s; everything here is about moving events.
No text: the ingress makes it from the token ids (deploy/output.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from deploy.protocol import EngineChunk, EngineError, EngineEvent, SampleDelta
from deploy.stream.chunks import merge_runs
from workers.request import RequestOutput

if TYPE_CHECKING:
    from deploy.server_pd import FirstToken

logger = logging.getLogger("m3serve.server")

SUBSCRIPTION_IDLE_S = 1.0  # an idle subscription still sends an empty item this often (a gone subscriber shows)


class DeltaTracker:
    """Remembers what was already sent per sample, to turn cumulative `RequestOutput`s into `EngineChunk`s."""

    def __init__(self, first: "FirstToken | None" = None) -> None:
        self._tokens: dict[int, int] = {}
        self.done: set[int] = set()  # samples whose finish went out
        self._first = True
        if first is not None:  # decode side: the first token went out from prefill
            self._tokens[0], self._first = 1, False

    def chunk(self, out: RequestOutput) -> EngineChunk | None:
        samples = []
        for comp in out.outputs:
            if comp.index in self.done:
                continue
            n_tok = self._tokens.get(comp.index, 0)
            end = sent_until(comp)
            new_ids = comp.token_ids[n_tok:end]
            new_lp = None if comp.logprobs is None else [dict(d) for d in comp.logprobs[n_tok:end]]
            finished = comp.finish_reason is not None
            if not new_ids and not finished:
                continue
            samples.append(SampleDelta(index=comp.index, token_ids=new_ids, logprobs=new_lp,
                                       finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
            self._tokens[comp.index] = end
            if finished:
                self.done.add(comp.index)
        if not samples and not self._first and not out.finished:
            return None
        chunk = EngineChunk(request_id=out.request_id, samples=samples, finished=out.finished)
        if self._first:
            chunk.prompt_token_ids = list(out.prompt_token_ids)
            chunk.prompt_logprobs = out.prompt_logprobs
            self._first = False
        return chunk


def sent_until(comp) -> int:
    """How many of a sample's tokens a chunk made from `comp` carries. The engine hands out its live token list
    (no copy per step), which its step thread may extend while this output waits to be sent (a consumer that fell
    behind): count it once, and no further than the output's own logprobs snapshot, so no token (or its logprob)
    is counted as sent without being sent."""
    end = len(comp.token_ids)
    return end if comp.logprobs is None else min(end, len(comp.logprobs))


class Outbox:
    """What one subscriber (an ingress replica) has not received yet: per request, the events that came since its
    subscription's previous item (merged when it is sent); and the task moving each of its requests' events in."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}
        self.pumps: dict[str, asyncio.Task] = {}
        self.wake = asyncio.Event()

    def put(self, request_id: str, event) -> None:
        self.pending.setdefault(request_id, []).append(event)
        self.wake.set()

    def take(self) -> list[tuple[str, EngineEvent]]:
        """Everything pending, one merged chunk per request (errors kept apart, in order)."""
        batch = [(rid, e) for rid, events in self.pending.items() for e in merge_runs(events)]
        self.pending.clear()
        return batch

    def pump(self, request_id: str, events: AsyncIterator[EngineEvent]) -> None:
        """Move one request's events in, on a task of its own (cancelled by `cancel` or `close`)."""
        self.pumps[request_id] = asyncio.ensure_future(self._pump(request_id, events))

    async def _pump(self, rid: str, events: AsyncIterator[EngineEvent]) -> None:
        """Cancelled (abort, subscriber gone): the request's stream closes, which aborts it in the engine."""
        try:
            async for event in events:
                self.put(rid, event)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the subscriber gets an answer, not a hang
            logger.exception("request %s: stream failed", rid)
            self.put(rid, EngineError(status=500, message=f"the engine stream failed ({type(e).__name__})",
                                      code="internal_error"))
        finally:
            self.pumps.pop(rid, None)

    def cancel(self, request_id: str) -> None:
        task = self.pumps.get(request_id)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        """The subscriber is gone: stop its requests (each pump's stream aborts in the engine, freeing pages)."""
        for task in list(self.pumps.values()):
            task.cancel()


class Publisher:
    """The subscriptions one engine replica serves: an `Outbox` per subscriber (an ingress replica), each sent as
    one stream (`serve`) whose items carry all its requests' new events at once, so the Serve cost per step does
    not grow with the batch."""

    def __init__(self) -> None:
        self._boxes: dict[str, Outbox] = {}  # subscriber -> its requests' unsent events

    async def serve(self, subscriber: str) -> AsyncIterator[list[tuple[str, EngineEvent]]]:
        """`subscriber`'s stream: each item holds what all its requests produced since the previous item ((request
        id, event) pairs, a request's chunks merged); an empty one at least every `SUBSCRIPTION_IDLE_S`. The first
        item is empty: from then on `start` may name `subscriber`. A subscriber that comes back replaces its old
        stream (what it started before is gone); ending the stream (the subscriber left) aborts its requests."""
        box = Outbox()
        old = self._boxes.get(subscriber)
        if old is not None:
            old.close()
        self._boxes[subscriber] = box
        try:
            yield []
            while True:
                try:
                    await asyncio.wait_for(box.wake.wait(), SUBSCRIPTION_IDLE_S)
                except asyncio.TimeoutError:
                    yield []
                    continue
                box.wake.clear()
                batch = box.take()
                if batch:
                    yield batch
        finally:
            if self._boxes.get(subscriber) is box:
                del self._boxes[subscriber]
            box.close()

    def serves(self, subscriber: str) -> bool:
        """Whether `subscriber` has a stream here (not: this replica restarted since it subscribed)."""
        return subscriber in self._boxes

    def start(self, subscriber: str, request_id: str, events: AsyncIterator[EngineEvent]) -> None:
        """Send the request's `events` through `subscriber`'s stream (`serves(subscriber)` must hold)."""
        self._boxes[subscriber].pump(request_id, events)

    def cancel(self, request_id: str) -> None:
        """Stop moving the request's events (an abort): its stream closes, which aborts it in the engine."""
        for box in self._boxes.values():
            box.cancel(request_id)
