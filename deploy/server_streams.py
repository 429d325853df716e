"""What an `EngineServer` streams: an engine's cumulative outputs turned into token deltas (`DeltaTracker`), and
one subscriber's not-yet-sent events (`Outbox`). Split from deploy/server.py (the Serve deployment) by concern.
No text: the ingress makes it from the token ids (deploy/output.py)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from deploy.protocol import EngineChunk, EngineEvent, SampleDelta
from deploy.streaming import merge_runs
from workers.request import RequestOutput

if TYPE_CHECKING:
    from deploy.server import FirstToken


class DeltaTracker:
    """Remembers what was already sent per sample, to turn cumulative `RequestOutput`s into `EngineChunk`s."""

    def __init__(self, first: "FirstToken | None" = None) -> None:
        self._tokens: dict[int, int] = {}
        self._done: set[int] = set()
        self._first = True
        if first is not None:  # decode side: the first token went out from prefill
            self._tokens[0], self._first = 1, False

    def chunk(self, out: RequestOutput) -> EngineChunk | None:
        samples = []
        for comp in out.outputs:
            if comp.index in self._done:
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
                self._done.add(comp.index)
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

    def close(self) -> None:
        """The subscriber is gone: stop its requests (each pump's stream aborts in the engine, freeing pages)."""
        for task in list(self.pumps.values()):
            task.cancel()
