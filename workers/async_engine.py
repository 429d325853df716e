"""`AsyncEngine`: an `Engine` stepped by a background thread, with asyncio streaming for servers.

The event loop never waits for a step: `generate` validates the request on the caller's thread (so a bad
request fails before anything is queued), hands it to the step thread through an inbox, and awaits outputs
that the step thread pushes into a per-request `asyncio.Queue` with `call_soon_threadsafe`. Only the step thread
touches the Engine; adds and aborts are applied between steps. Leaving the async iterator early (the client went
away) queues an abort, which frees the request's pages before the next step.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from workers.engine import Engine
from workers.request import RequestOutput, SamplingParams
from workers.stats import EngineStats, RequestStats, StepStats


class QueueFullError(RuntimeError):
    """More than `engine_config.max_waiting` requests are waiting; the server answers 429."""


class EngineDeadError(RuntimeError):
    """The step thread stopped on an error; the engine serves nothing more."""


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], Engine] | Engine) -> None:
        self.engine = engine_factory if isinstance(engine_factory, Engine) else engine_factory()
        self.max_waiting = self.engine.engine_config.max_waiting
        self._lock = threading.Lock()  # guards the inbox, the streams and the published stats
        self._inbox: deque[tuple] = deque()
        self._pending_adds = 0
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = self.engine.stats()
        self._request_stats: deque[RequestStats] = deque()
        self._step_stats: deque[StepStats] = deque(maxlen=4096)
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    # ---- the asyncio side -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request as tokens appear; the last has `.finished` set.

        Raises ValueError (bad request) or QueueFullError before the first output."""
        stream = self._submit(request_id, list(prompt_token_ids), params, prompt)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                prompt: str | None) -> _Stream:
        if self._error is not None:
            raise EngineDeadError(f"engine: the step thread failed: {self._error!r}") from self._error
        self.engine.validate_request(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            if self._stats.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFullError(f"max_waiting: {self.max_waiting} requests are already waiting")
            self._streams[request_id] = stream
            self._pending_adds += 1
            self._inbox.append(("add", request_id, prompt_token_ids, params, prompt))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request in any state (no-op if unknown); its stream gets nothing more."""
        with self._lock:
            self._streams.pop(request_id, None)
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step."""
        return self._stats

    def pop_request_stats(self) -> list[RequestStats]:
        with self._lock:
            out = list(self._request_stats)
            self._request_stats.clear()
        return out

    def pop_step_stats(self) -> list[StepStats]:
        with self._lock:
            out = list(self._step_stats)
            self._step_stats.clear()
        return out

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step thread (in-flight requests are aborted) and release the engine."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- the step thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    idle = not self._inbox and not self._stopping
                if idle and not self.engine.has_unfinished():
                    self._wake.wait()
                self._wake.clear()
                if self._apply_inbox():
                    return
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._publish(outputs)
        except BaseException as e:  # noqa: BLE001 - every waiter must learn the engine is gone
            self._error = e
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.put(EngineDeadError(f"engine: the step thread failed: {e!r}"))

    def _apply_inbox(self) -> bool:
        """Apply queued adds and aborts in arrival order. True when shutting down (everything aborted)."""
        with self._lock:
            ops, self._inbox = list(self._inbox), deque()
            stopping = self._stopping
        for op in ops:
            if op[0] == "add":
                _, rid, ids, params, prompt = op
                with self._lock:
                    self._pending_adds -= 1
                    stream = self._streams.get(rid)
                if stream is None:
                    continue  # aborted before it was added
                try:
                    self.engine.add_request(rid, ids, params, prompt=prompt)
                except ValueError as e:  # validated already; a race on the id is all that is left
                    with self._lock:
                        self._streams.pop(rid, None)
                    stream.put(e)
            else:
                self.engine.abort_request(op[1])
        if stopping:
            self.engine.abort_all()
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.put(EngineDeadError("engine: shut down"))
        self._publish([])
        return stopping

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.stats()
        req_stats = self.engine.pop_request_stats()
        step_stats = self.engine.pop_step_stats()
        with self._lock:
            self._stats = stats
            self._request_stats.extend(req_stats)
            self._step_stats.extend(step_stats)
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
            for o in outputs:
                if o.finished:
                    self._streams.pop(o.request_id, None)
        for stream, out in targets:
            if stream is not None:
                stream.put(out)
