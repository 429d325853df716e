"""`AsyncEngine`: an `Engine` stepped by a background thread, with asyncio streaming for servers.

The event loop never waits for a step: `generate` validates the request on the caller's thread (so a bad
request fails before anything is queued), hands it to the step thread through an inbox, and awaits outputs
that the step thread pushes into a per-request `asyncio.Queue` with `call_soon_threadsafe`. Only the step thread
touches the Engine; adds, stops and aborts are applied between steps. Leaving the async iterator early (the client
went away) queues an abort, which frees the request's pages before the next step. Outputs carry token ids, not text:
whoever shows the text finds stop strings in it and calls `stop` (the sample finishes "stop" before the next step).

Disaggregation: a prefill engine's `generate(..., handoff_to=group)` streams the first token, then
`transfer_outcome(request_id)` tells whether its KV reached the decode group. A decode engine's
`admit_remote` reserves pages (run on the step thread); the request starts decoding as soon as its KV landed
(the first token comes with it), whether or not anyone streams it yet: its outputs are parked until
`generate_remote` attaches (which streams the rest, or raises `KVTransferFailed`), for at most the transfer
lease. Transfers move on inside steps (their commands and results ride each step, workers/engine_kv.py): while
transfers are pending and no batch runs, the step thread runs a KV-only step whenever one would change something
(commands queued, a request ready), on every settled transfer (a listener on in-process transfer agents), and
otherwise at most every `TRANSFER_POLL_S` (results from shard actors, leases and timeouts).

`debug_timeline(since)` answers where the time went: the step thread keeps the latest `TIMELINE_STEPS` steps
(wall-clock start/end, forward vs host time, the loop's time between steps, tokens per request) in a ring it alone
appends to, and the engine keeps its KV handoff marks; `EngineServer.debug_timeline` serves both to benchmarks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.engine_api import EngineAPI
from workers.kv.connector import KVTransferFailed
from workers.request import RequestOutput, SamplingParams
from workers.stats import EngineStats, RequestStats, StepStats, TransferStats
from workers.step_thread import StepPlacement

TRANSFER_POLL_S = 0.02
_KEEP_FAILURES = 1024
TIMELINE_STEPS = 20_000  # steps kept for `debug_timeline` (minutes of decode at ~10 ms a step)
# One `debug_timeline` step record. start/end: time.time() around `Engine.step` (wall clock, to line up with other
# processes on the host); forward_s/host_s: the step's StepStats split; then what the loop did since the previous
# recorded step ended: publish_s handing outputs to the streams, idle_s blocked waiting for work, inbox_s applying
# adds/aborts/calls; tokens: (request id, output tokens so far) of every request that progressed. A step is
# recorded before its outputs reach the streams, so a caller that saw its last token sees the step too.
STEP_FIELDS = ("start", "end", "prefill_tokens", "decode_tokens", "batch_size", "forward_s", "host_s", "idle_s",
               "inbox_s", "publish_s", "tokens")


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


def _open_stream(placement: StepPlacement, caller_threads: set[int]) -> _Stream:
    """A stream on the calling loop. That loop's thread publishes the tokens, so it takes the step thread's
    niceness (M3SERVE_STEP_NICE; once per thread, `caller_threads` remembers). A function, not a method: AsyncEngine
    is at its method budget (tests/test_architecture.py)."""
    placement.apply_to_caller(caller_threads)
    return _Stream(asyncio.get_running_loop(), asyncio.Queue())


def _put_all(items: list[tuple[_Stream, object]]) -> None:
    """Each item into its stream's queue: one `call_soon_threadsafe` per event loop for the whole step, not one per
    request: each such call takes the loop's lock and writes to its wake-up pipe, on the step thread (16 outputs:
    70-95 us one by one, 10 us batched, in a one-off timing loop on the 2-core dev machine)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_pairs, pairs)
        except RuntimeError:
            pass  # the callers' loop is closed: nobody is listening


def _put_pairs(pairs: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], EngineAPI] | EngineAPI) -> None:
        self._placement = StepPlacement.from_env()  # first: a bad value fails before the load
        self._caller_threads: set[int] = set()  # the submitting threads whose niceness is set (event loops)
        self.engine = engine_factory if isinstance(engine_factory, EngineAPI) else engine_factory()
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
        self._transfer_stats: deque[TransferStats] = deque(maxlen=4096)
        self._outcomes: dict[str, concurrent.futures.Future] = {}  # prefill: request id -> (ok, reason)
        self._failed: OrderedDict[str, str] = OrderedDict()  # decode failures nobody was streaming yet
        # decode: the newest output of a request that started decoding before its stream attached, and since when
        self._parked: dict[str, tuple[RequestOutput, float]] = {}
        self._dropping: set[str] = set()  # aborted, abort not applied yet: their outputs are not parked
        self._parks = getattr(self.engine, "role", "unified") == "decode"
        self.park_timeout_s = getattr(getattr(self.engine, "transfer_config", None), "lease_s", 60.0)
        # only prefill/decode engines move KV (a dp > 1 engine is unified and has none of those calls)
        self._disaggregated = getattr(self.engine, "role", "unified") != "unified"
        if self._disaggregated:
            self.engine.add_transfer_listener(self._wake.set)
        self._timeline: deque[tuple] = deque(maxlen=TIMELINE_STEPS)  # appended by the step thread only
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    # ---- the asyncio side -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None, *, handoff_to: str | None = None,
                       transfer_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request as tokens appear; the last has `.finished` set.

        Raises ValueError (bad request) or QueueFullError before the first output, `StepFailedError` if a step
        that ran it failed (the request is gone; the engine serves on). `handoff_to` (prefill role): after the
        first token the KV goes to that decode group; see `transfer_outcome`."""
        handoff = (handoff_to, transfer_id) if handoff_to is not None else None
        stream = self._submit(request_id, list(prompt_token_ids), params, prompt, handoff)
        async for out in self._drain(request_id, stream):
            yield out

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = _newest(stream.queue, await stream.queue.get())
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
                prompt: str | None, handoff: tuple[str, str | None] | None = None) -> _Stream:
        self._check_alive()
        self.engine.validate_request(prompt_token_ids, params)
        stream = _open_stream(self._placement, self._caller_threads)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            if self._stats.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFullError(f"max_waiting: {self.max_waiting} requests are already waiting")
            self._streams[request_id] = stream
            self._pending_adds += 1
            if handoff is not None:
                self._outcomes[request_id] = concurrent.futures.Future()
            self._inbox.append(("add", request_id, prompt_token_ids, params, prompt, handoff))
        self._wake.set()
        return stream

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine: the step thread failed: {self._error!r}") from self._error

    # ---- disaggregation -----------------------------------------------------------------------------------
    async def call(self, fn: Callable[[EngineAPI], Any]) -> Any:
        """Run `fn(engine)` on the step thread, between steps; returns its result (or raises its error)."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._inbox.append(("call", fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    async def admit_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                           group: str, transfer_id: str | None = None,
                           prompt: str | None = None) -> list[int] | None:
        """Decode role: reserve pages for a prompt that prefill group `group` computes (None: no room now)."""
        self.engine.validate_request(list(prompt_token_ids), params)
        return await self.call(lambda e: e.admit_remote(request_id, prompt_token_ids, params, group=group,
                                                        transfer_id=transfer_id, prompt=prompt))

    async def generate_remote(self, request_id: str, first_token: int | None,
                              first_logprobs: dict[int, float] | None = None) -> AsyncIterator[RequestOutput]:
        """Decode role: stream an admitted request from its first token on (the first output already holds
        it; if it started decoding before this call, the first output holds everything so far). Raises
        KVTransferFailed if its KV never lands. `first_token`: what the prefill sampled (the KV header brings the
        same; it is what a request admitted with `first_from_kv=False` starts from); None: not known yet (the
        stream opened before the prefill ran), the KV header brings it."""
        self._check_alive()
        stream = _open_stream(self._placement, self._caller_threads)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            failed = self._failed.pop(request_id, None)
            parked = self._parked.pop(request_id, (None,))[0]
            if failed is None and not (parked is not None and parked.finished):
                self._streams[request_id] = stream
                if parked is None and first_token is not None:
                    self._inbox.append(("continue", request_id, first_token, first_logprobs))
        if failed is not None:
            raise KVTransferFailed(failed)
        if parked is not None:
            if parked.finished:
                if parked.error is not None:  # a step that ran it failed before anyone streamed it
                    raise parked.error
                yield parked
                return
            stream.queue.put_nowait(parked)  # ahead of anything the step thread sends from now on
        else:
            self._wake.set()
        async for out in self._drain(request_id, stream):
            yield out

    async def fail_remote(self, request_id: str, why: str) -> bool:
        """Decode role: the request's KV will not come (its prefill said so): fail it now instead of at its
        lease; its stream (now or when it attaches) raises `KVTransferFailed(why)`. False when it is not waiting
        for its KV (landed already, unknown, failed or aborted)."""
        return await self.call(lambda e: e.fail_remote(request_id, why))

    async def transfer_outcome(self, request_id: str, timeout_s: float | None = None) -> tuple[bool, str | None]:
        """Prefill role: (ok, reason) once the KV of a handed-off request settled. (False, why) if the
        request never handed off (aborted first) or `timeout_s` passed."""
        with self._lock:
            fut = self._outcomes.get(request_id)
        if fut is None:
            return False, "no transfer for this request"
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except asyncio.TimeoutError:
            return False, f"timeout: no outcome within {timeout_s} s"
        finally:
            with self._lock:
                self._outcomes.pop(request_id, None)

    def pop_transfer_stats(self) -> list[TransferStats]:
        with self._lock:
            out = list(self._transfer_stats)
            self._transfer_stats.clear()
        return out

    def abort(self, request_id: str) -> None:
        """Abort a request in any state (no-op if unknown); its stream gets nothing more."""
        with self._lock:
            self._streams.pop(request_id, None)
            self._parked.pop(request_id, None)
            self._dropping.add(request_id)
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def stop(self, request_id: str, index: int, stop: str) -> None:
        """A stop string ended sample `index` of a request (its text is made outside the engine): finish it
        with reason "stop" between steps; its stream gets that finish (no-op if the request already ended)."""
        with self._lock:
            self._inbox.append(("stop", request_id, index, stop))
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

    def debug_timeline(self, since: float = 0.0) -> dict:
        """Steps (`STEP_FIELDS` tuples) and the engine's handoff marks ((time, kind, request id, transfer phase
        marks)) that ended at or after `since` (time.time()); for benchmarks explaining where latency goes."""
        steps = [s for s in _snapshot(self._timeline) if s[1] >= since]
        marks = [m for d in _mark_sources(self.engine) for m in _snapshot(d) if m[0] >= since]
        marks.sort(key=lambda m: m[0])
        return {"pid": os.getpid(), "now": time.time(), "role": getattr(self.engine, "role", "unified"),
                "step_fields": STEP_FIELDS, "steps": steps, "marks": marks}

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
        idle_s = inbox_s = publish_s = 0.0  # loop time since the last recorded step (the timeline's gaps)
        try:
            self._placement.apply()  # M3SERVE_STEP_CPUS / M3SERVE_STEP_NICE, this thread only
            while True:
                with self._lock:
                    idle = not self._inbox and not self._stopping
                t = time.perf_counter()
                if self._disaggregated:
                    if idle and not self.engine.has_runnable():
                        # transfers settle on other threads (an in-process listener sets _wake; shard actors report
                        # in the next KV-only step); leases need a clock. Nothing changed: wait, do not spin
                        self._wake.wait(TRANSFER_POLL_S if self.engine.has_pending_transfers() else None)
                elif idle and not self.engine.has_unfinished():
                    self._wake.wait()
                self._wake.clear()
                t1 = time.perf_counter()
                idle_s += t1 - t
                if self._apply_inbox():
                    return
                inbox_s += time.perf_counter() - t1
                if self.engine.has_unfinished():
                    start = time.time()
                    outputs = self.engine.step()
                    end = time.time()
                    # a step that only polled transfers ran no batch and is not recorded: its time stays in the gap
                    if self._publish(outputs, (start, end, idle_s, inbox_s, publish_s)):
                        idle_s = inbox_s = publish_s = 0.0
                    publish_s += time.time() - end
        except BaseException as e:  # noqa: BLE001 - every waiter must learn the engine is gone
            self._error = e
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.put(EngineDeadError(f"engine: the step thread failed: {e!r}"))

    def _apply_inbox(self) -> bool:
        """Apply queued adds, stops and aborts in arrival order. True when shutting down (everything aborted)."""
        with self._lock:
            ops, self._inbox = list(self._inbox), deque()
            stopping = self._stopping
        stopped: list[RequestOutput] = []  # outputs of samples a stop string ended (`stop`)
        for op in ops:
            if op[0] == "add":
                _, rid, ids, params, prompt, handoff = op
                with self._lock:
                    self._pending_adds -= 1
                    stream = self._streams.get(rid)
                if stream is None:
                    self._settle_outcome(rid, False, "aborted before it started")
                    continue  # aborted before it was added
                try:
                    if handoff is None:
                        self.engine.add_request(rid, ids, params, prompt=prompt)
                    else:
                        self.engine.add_request(rid, ids, params, prompt=prompt, handoff_to=handoff[0],
                                                transfer_id=handoff[1])
                        if not self.engine.hands_off(rid):  # nothing to hand off (max_tokens 1)
                            self._settle_outcome(rid, False, "no handoff: the request ends at prefill")
                except ValueError as e:  # validated already; a race on the id is all that is left
                    with self._lock:
                        self._streams.pop(rid, None)
                    self._settle_outcome(rid, False, str(e))
                    stream.put(e)
            elif op[0] == "call":
                _, fn, fut = op
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # handed back to the caller
                    fut.set_exception(e)
            elif op[0] == "continue":
                _, rid, token, logprobs = op
                try:
                    self.engine.continue_remote(rid, token, logprobs)
                except KeyError as e:
                    with self._lock:
                        stream = self._streams.pop(rid, None)
                        why = self._failed.pop(rid, None)
                    if stream is not None:
                        stream.put(KVTransferFailed(why or str(e.args[0])))
            elif op[0] == "stop":
                _, rid, index, stop = op
                stopped += self.engine.stop_sample(rid, index, stop)
            else:
                self.engine.abort_request(op[1])
                with self._lock:
                    self._dropping.discard(op[1])
        if stopping:
            self.engine.abort_all()
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.put(EngineDeadError("engine: shut down"))
        self._publish(stopped)
        return stopping

    def _settle_outcome(self, request_id: str, ok: bool, reason: str | None) -> None:
        with self._lock:
            fut = self._outcomes.get(request_id)
        if fut is not None and not fut.done():
            fut.set_result((ok, reason))

    def _record(self, steps: list[StepStats], window: tuple[float, float, float, float, float],
                outputs: list[RequestOutput]) -> None:
        """Append one timeline record per StepStats of the step that ran in `window` = (start, end, idle_s,
        inbox_s, publish_s)."""
        start, end, idle_s, inbox_s, publish_s = window
        tokens = tuple((o.request_id, len(o.outputs[0].token_ids)) for o in outputs if o.outputs)
        for s in steps:
            s.start_time = start
            forward = s.step_time - s.host_overhead
            self._timeline.append((start, end, s.num_prefill_tokens, s.num_decode_tokens, s.batch_size, forward,
                                   s.host_overhead, idle_s, inbox_s, publish_s, tokens))

    def _publish(self, outputs: list[RequestOutput], window: tuple | None = None) -> bool:
        """Hand outputs, failures and stats to the asyncio side. With `window` (the step that made `outputs`, see
        `_record`): record it first. True when a step was recorded."""
        stats = self.engine.stats()
        req_stats = self.engine.pop_request_stats()
        step_stats = self.engine.pop_step_stats()
        if window is not None and step_stats:
            self._record(step_stats, window, outputs)
        transfer_stats, failures = [], []
        if self._disaggregated:
            transfer_stats = self.engine.pop_transfer_stats()
            for rid, ok, reason in self.engine.pop_transfer_outcomes():
                self._settle_outcome(rid, ok, reason)
            failures = self.engine.pop_failures()
        with self._lock:
            self._stats = stats
            self._request_stats.extend(req_stats)
            self._step_stats.extend(step_stats)
            self._transfer_stats.extend(transfer_stats)
            failed_streams = []
            for rid, why in failures:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    failed_streams.append((stream, why))
                else:  # its decode stream has not started yet: it learns the reason when it does
                    self._failed[rid] = why
                    while len(self._failed) > _KEEP_FAILURES:
                        self._failed.popitem(last=False)
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
            for o in outputs:
                if o.finished:
                    self._streams.pop(o.request_id, None)
                if o.error is not None:  # no transfer_outcome call follows a failed prefill
                    self._outcomes.pop(o.request_id, None)
            expired = []
            if self._parks:
                expired = self._park([o for stream, o in targets if stream is None])
        # a request a failed step ended gets its error instead of its last output
        _put_all([(stream, out if out.error is None else out.error) for stream, out in targets if stream is not None]
                 + [(stream, KVTransferFailed(why)) for stream, why in failed_streams])
        if expired:  # started decoding, but nobody came for it: stop it, free its pages
            for rid in expired:
                self.engine.abort_request(rid)
            with self._lock:
                self._stats = self.engine.stats()
        return window is not None and bool(step_stats)

    def _park(self, outputs: list[RequestOutput]) -> list[str]:
        """(Lock held.) Keep the newest output of decode requests that run before their stream attached
        (`generate_remote` picks it up); forget those parked longer than the transfer lease. Returns the ids
        forgotten while still running (the caller aborts them)."""
        now = time.monotonic()
        for o in outputs:
            if o.request_id not in self._dropping:  # not an aborted request's last output
                since = self._parked.get(o.request_id, (None, now))[1]
                self._parked[o.request_id] = (o, since)
        if not self._parked:
            return []
        stale = [rid for rid, (_, since) in self._parked.items() if now - since > self.park_timeout_s]
        return [rid for rid in stale if not self._parked.pop(rid)[0].finished]


def _newest(queue: asyncio.Queue, item: RequestOutput | BaseException) -> RequestOutput | BaseException:
    """`item`, or the newest output queued behind it. Outputs are cumulative (all tokens, text and logprobs so
    far), so a consumer that fell behind needs only the latest: it moves several tokens at once instead of
    working through every step's output (each then costing it a Serve item, an SSE event...). An error queued
    behind outputs stays queued: the consumer gets the newest output first, then the error."""
    while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, BaseException):
            queue.put_nowait(nxt)  # nothing follows an error, so it stays last
            break
        item = nxt
    return item


def _mark_sources(engine: EngineAPI) -> list[deque]:
    """The mark buffers of an engine: each rank's KV connector's (one per dp rank)."""
    return [kv.marks for kv in engine.connectors]


def _snapshot(ring: deque) -> list:
    """A copy of a ring the step thread appends to, without a lock on its path: copying runs in C under the GIL,
    so it only fails (RuntimeError) if the copy itself was interrupted by an append; try again then."""
    for _ in range(10):
        try:
            return list(ring)
        except RuntimeError:
            continue
    return []
