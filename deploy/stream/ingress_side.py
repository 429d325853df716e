"""The ingress's half of the ingress <-> engine stream (deploy/stream/__init__.py): each engine request's event
stream, how it ends, and what it owes when it ends.

A request goes to the router, which answers a `Redirect` (or, disaggregated, streams the prefill's first token and
then redirects); the tokens then come straight from the named engine replica, through one subscription per engine
replica shared by all this ingress replica's requests (`Subscription`, `EngineStreams`). A stream that ends early
(the client left, the server drains) owes its engine an abort and the router a release; those run in the background.

The engine streams token ids; each `Stream` makes their text as they arrive (deploy/output.py `ChunkText`: one
detokenizer per sample, stop strings). A stop string found there ends its sample for the client at once and is
sent to the engine replica (`EngineStreams.stop`), which stops the sample before its next step; a request whose
stop string came before it reached an engine replica (a disaggregated first token, still at the router) is
aborted instead when its stream closes.

Every call that must outlive the HTTP request that made it (an abort, a release, a request's start, the shared
subscription) is made `detached`: Serve cancels the calls a cancelled HTTP request made, pending or in flight, when
the cancellation reaches its replica wrapper, so an abort sent from the request's own cleanup was cancelled in about
1 of 3 runs of the e2e metrics test (issue 22: the request then ran on to its `max_tokens`), and a subscription
opened by a request whose client left was cut for every request on it.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deploy.errors import ApiError
from deploy.metrics_endpoint import RequestTiming
from deploy.output import ChunkText
from deploy.owners import this_owner
from deploy.protocol import SSE_DONE, EngineChunk, EngineError, Redirect, sse_event
from deploy.stream.chunks import EventQueue

logger = logging.getLogger("m3serve.ingress")

RELEASE_FLUSH_S = 0.05  # ended direct streams wait this long for a router call to ride on (EngineStreams.release)
DRAIN_POLL_S = 0.05  # how often a drain looks whether the open streams ended
DRAIN_CLOSE_S = 5.0  # after the grace period, how long the ended streams' consumers get to close them
T = TypeVar("T")
# The ingress's calls to engine replicas (start, stop / abort, the subscription stream) go over Serve's
# inter-deployment gRPC (`_by_reference=False`: every replica runs that server) instead of Ray actor calls whose
# results travel as object refs. On the CPU proxy (docs/benchmarks.md S1) it cut the ingress's CPU per token by a
# quarter to a half and TTFT at 16 streams by 12-50%; not yet measured on the GPU machine.
# M3SERVE_ENGINE_GRPC=0 (the ingress replicas' environment) goes back to actor calls.
ENGINE_CALLS_BY_REFERENCE = os.environ.get("M3SERVE_ENGINE_GRPC", "1") == "0"


def detached(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` made in an empty context: a Serve handle call made so is no HTTP request's child, so Serve does
    not cancel it when that request is cancelled (a client that hung up). Tasks it creates inherit that context."""
    return contextvars.Context().run(call, *args)


def _as_task(call: Callable[..., Any], *args: Any) -> asyncio.Future:
    return asyncio.ensure_future(call(*args))


class Subscription:
    """This ingress replica's one stream from one engine replica (`EngineServer.subscribe`): every step's events of
    all the requests it started there arrive as one item, and are handed to each request's `EventQueue`. When it
    breaks (the replica died or restarted) every request on it fails and it is `broken`: the next request opens
    a new one (`EngineStreams`)."""

    def __init__(self, handle: DeploymentHandle, subscriber: str) -> None:
        self._handle = handle
        self._subscriber = subscriber
        self._queues: dict[str, EventQueue] = {}
        self.broken = False
        # detached: shared by every request; the one whose call opened it may be cancelled (its client left)
        self._gen = detached(handle.options(stream=True).subscribe.remote, subscriber)
        self._open = asyncio.get_running_loop().create_future()  # done once the replica took the subscription
        self._task = asyncio.ensure_future(self._run())

    async def start(self, r: Redirect, queue: EventQueue,
                    owner: "Stream | None" = None) -> EngineChunk | EngineError | None:
        """Start the redirected request on the replica; its events go to `queue` (registered first: they may come
        through the subscription before the call's answer). None: started (every event comes through `queue`);
        else the replica's refusal, or its first event (a replica that answers it: nothing more of that one
        goes to `queue` when it ends the request). The start call runs to its answer even if the caller is
        cancelled: `owner.start_call` holds it, and the owner's abort goes out only after it (an abort that
        overtook its start found nothing to abort, and the request then ran to its end)."""
        await asyncio.shield(self._open)
        self._queues[r.request_id] = queue
        call = detached(_as_task, self._handle.start.remote, self._subscriber, r.method, r.args)
        if owner is not None:
            owner.start_call = call
        try:
            first = await asyncio.shield(call)
        except BaseException:
            self._queues.pop(r.request_id, None)
            raise
        if first is not None and (isinstance(first, EngineError) or first.finished):
            self._queues.pop(r.request_id, None)
            if isinstance(first, EngineError) and first.code == "engine_unavailable":
                self.close()  # the replica lost this subscription: the next request opens a new one
        return first

    def forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _run(self) -> None:
        error: BaseException = RuntimeError("the engine replica ended the subscription")
        try:
            async for batch in self._gen:
                if not self._open.done():
                    self._open.set_result(None)
                for rid, event in batch:
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put(event)
                        if isinstance(event, EngineError) or event.finished:
                            del self._queues[rid]
        except BaseException as e:  # noqa: BLE001 - handed to every request on it
            error = e
        self.broken = True
        if not self._open.done():
            self._open.set_exception(error)
            self._open.exception()  # retrieved: the waiting requests get it through their shield
        queues, self._queues = list(self._queues.values()), {}
        for queue in queues:
            queue.fail(error)

    def close(self) -> None:
        self.broken = True
        self._gen.cancel()


class EngineStreams:
    """The engine replicas a `Redirect` names (one handle and one subscription per deployment, made on first use),
    the streams still open (`live`: what a drain waits for, then ends), and the calls a direct stream owes when it
    ends: the router's `release`, an abort on the replica if it was cut short. Those run in the background: the
    client's response does not wait for them."""

    def __init__(self, router: DeploymentHandle) -> None:
        self._router = router
        self._handles: dict[tuple[str, str], DeploymentHandle] = {}
        self._subscriptions: dict[tuple[str, str], Subscription] = {}
        self._subscriber = f"ingress-{uuid.uuid4().hex[:12]}"
        # this ingress replica's Ray actor, named with every request: if it dies, the router aborts and releases
        # what it held (deploy/owners.py)
        self.owner = this_owner()
        self._pending: set[asyncio.Future] = set()  # background calls, referenced until they are done
        self._released: list[str] = []  # ended direct streams the router has not been told of yet
        self._placed: list[str] = []  # requests started here without the router (`direct`), not told of yet
        self._flush: asyncio.TimerHandle | None = None
        self.live: set[Stream] = set()  # streams not closed yet

    async def stream(self, r: Redirect, owner: "Stream") -> AsyncIterator[EngineChunk | EngineError]:
        """The redirected request's events, through the subscription (`start` starts it)."""
        sub = self._subscription(r)
        queue = EventQueue()
        owner.started, owner.queue = r, queue
        try:
            first = await sub.start(r, queue, owner)
            if first is not None:
                yield first
                if isinstance(first, EngineError) or first.finished:
                    return
            async for event in queue:
                yield event
        finally:
            sub.forget(r.request_id)

    def _subscription(self, r: Redirect) -> Subscription:
        key = (r.app_name, r.deployment)
        sub = self._subscriptions.get(key)
        if sub is None or sub.broken:
            sub = self._subscriptions[key] = Subscription(self._handle(r), self._subscriber)
        return sub

    def end_all(self, error: EngineError) -> int:
        """End every open stream with `error` (a drain's grace period is over); returns how many."""
        streams = list(self.live)
        for s in streams:
            s.end(error)
        return len(streams)

    async def drain(self, grace_s: float, error: EngineError) -> dict[str, int]:
        """Let the open streams end for up to `grace_s`, end the rest with `error` (an SSE error event, or the
        non-streaming request's error answer), and wait (bounded) until their aborts and releases went out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        open_at_start = len(self.live)
        while self.live and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        ended = self.end_all(error)
        deadline = loop.time() + DRAIN_CLOSE_S
        while self.live and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self._flush_released()
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=DRAIN_CLOSE_S)
        return {"open": open_at_start, "ended": ended, "left": len(self.live)}

    def close(self) -> None:
        """This ingress replica is going away: end its subscriptions (the engines abort what ran on them)."""
        for sub in self._subscriptions.values():
            sub.close()

    def release(self, release_id: str) -> None:
        """Tell the router a direct stream ended: with the next request's router call (`take_released`), or on
        its own after `RELEASE_FLUSH_S` if none comes (a call per request saved, its count stays right)."""
        self._released.append(release_id)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(RELEASE_FLUSH_S, self._flush_released)

    def direct(self, target: Redirect, req: Any) -> asyncio.Future:
        """`req` (an EngineRequest) started on the router's `direct_target` without asking the router: the
        `Redirect` a `Stream` follows (a done future, where `route` would answer one), and the router is told
        with the next flush, in the same call as the releases (placements first)."""
        self._placed.append(req.request_id)
        self._schedule_flush()
        done = asyncio.get_running_loop().create_future()
        done.set_result(dataclasses.replace(target, args=(req,), request_id=req.request_id,
                                            release_id=req.request_id))
        return done

    def take_released(self) -> list[str]:
        ids, self._released = self._released, []
        return ids

    def _flush_released(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self._flush = None
        ids, placed = self.take_released(), self._placed
        self._placed = []
        if ids or placed:
            self._background(self._send(self._router.release.remote, ids, placed, self.owner), "release")

    def stop(self, r: Redirect, index: int, stop: str, after: asyncio.Future | None = None) -> None:
        """Stop sample `index` of `r` on its replica: a stop string ended it here (its later tokens are nobody's).
        The replica finishes it as a stop string would have in the engine; its stream then ends as usual."""
        async def send() -> None:
            if after is not None:
                await asyncio.wait([after])
            await self._send(self._handle(r).stop.remote, r.request_id, index, stop)

        self._background(send(), "stop")

    def abort(self, r: Redirect, after: asyncio.Future | None = None) -> None:
        """Abort `r` on its replica, once its start call (`after`) has answered."""
        async def abort() -> None:
            if after is not None:
                await asyncio.wait([after])  # its outcome is the start's business, not the abort's
            await self._send(self._handle(r).abort.remote, r.request_id)

        self._background(abort(), "abort")

    @staticmethod
    async def _send(call: Callable[..., Any], *args: Any) -> Any:
        return await detached(call, *args)

    def _handle(self, r: Redirect) -> DeploymentHandle:
        key = (r.app_name, r.deployment)
        handle = self._handles.get(key)
        if handle is None:
            handle = serve.get_deployment_handle(r.deployment, app_name=r.app_name)
            handle = self._handles[key] = handle.options(_by_reference=ENGINE_CALLS_BY_REFERENCE)
        return handle

    def _background(self, work: Any, what: str) -> None:
        async def wait() -> None:
            try:
                await work
            except Exception as e:  # the replica is gone: nothing left to release or abort there
                logger.warning("%s after a direct stream failed: %r", what, e)

        task = asyncio.ensure_future(wait())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class Stream:
    """One engine request's event stream, with its first event already received: from the router, and after a
    `Redirect` straight from the engine replica it names (`engines`). `router`: the router's answer, a stream
    (`generate`) or a single `Redirect` / `EngineError` (`route`). `text`: makes the chunks' text (None: they
    keep the engine's, token ids only)."""

    def __init__(self, router: Any, request_id: str, engines: EngineStreams | None = None,
                 text: ChunkText | None = None) -> None:
        self.gen = router
        self.request_id = request_id
        self.engines = engines
        self.text = text
        self._stops: list[tuple[int, str]] = []  # stop strings found, not told to an engine replica yet
        self._owes_abort = False  # a stop string ended the request here, and no replica could be told
        self.redirect: Redirect | None = None
        self.started: Redirect | None = None  # set once the redirected request is being started on its replica
        self.start_call: asyncio.Future | None = None  # that start call (an abort waits for its answer)
        self.queue: EventQueue | None = None  # where the replica's events arrive, once redirected
        self.first: EngineChunk | EngineError | BaseException | None = None
        self.timing = RequestTiming()  # client-visible TTFT / e2e (deploy/metrics_endpoint.py)
        self.done = False
        self._ended: EngineError | None = None  # set by `end`: the error this stream ends with
        self._released = False
        self._aborted = False
        self._events = self._follow()
        if engines is not None:
            engines.live.add(self)

    async def _router_events(self) -> AsyncIterator[EngineChunk | EngineError | Redirect]:
        if hasattr(self.gen, "__aiter__"):
            async for event in self.gen:
                yield event
        else:
            yield await self.gen

    async def _follow(self) -> AsyncIterator[EngineChunk | EngineError]:
        """The router's events; after a `Redirect`, those of the engine replica's stream it names."""
        try:
            async for event in self._router_events():
                if isinstance(event, Redirect):
                    self.redirect = event
                    async for e in self.engines.stream(event, self):
                        yield e
                    return
                yield event
        except Exception:
            if self._ended is None:
                raise
            yield self._ended  # `end` cancelled the router's call: the stream ends with its error instead

    def end(self, error: EngineError) -> None:
        """End this stream with `error` as its next event, wherever it is (the server drains and its grace period
        is over); the request is aborted as the consumer closes the stream."""
        if self.done or self._ended is not None:
            return
        self._ended = error
        if self.queue is not None:
            self.queue.put(error)
        else:  # still at the router: cancel its call, `_follow` answers with the error
            self.gen.cancel()

    async def receive_first(self) -> None:
        try:
            self.first = await self._events.__anext__()
            self.timing.first_event()
        except StopAsyncIteration:
            self.first = EngineError(status=500, message="the engine ended the request without output",
                                     code="internal_error")
        except Exception as e:  # the router or an engine replica is gone
            self.first = e

    async def chunks(self) -> AsyncIterator[EngineChunk]:
        """The first chunk, then the rest until the request finishes; an error event raises ApiError. What
        arrived while the caller was busy (writing SSE events) comes as one chunk."""
        first = self._with_text(self.first)
        if self._last(first):
            yield first
            return
        yield first
        # the engine's events come through an EventQueue, which hands over what piled up meanwhile as one chunk
        async for event in self._events:
            event = self._with_text(event)
            if self._last(event):
                yield event
                return
            yield event
        self.done = True

    def _with_text(self, event: EngineChunk | EngineError) -> EngineChunk | EngineError:
        """`event` with its text made (in place); the stop strings found in it go to the engine replica (once the
        request runs on one: until then they wait, and a request they end before is aborted as it closes)."""
        if self.text is None or not isinstance(event, EngineChunk):
            return event
        engine_finished = event.finished
        self._stops += self.text.apply(event)
        if self._stops and self.started is not None:
            for index, stop in self._stops:
                self.engines.stop(self.started, index, stop, after=self.start_call)
            self._stops = []
        if event.finished and not engine_finished and self._stops:
            self._owes_abort = True
        return event

    def _last(self, event: EngineChunk | EngineError) -> bool:
        """Whether `event` ends the request (an error raises ApiError)."""
        if isinstance(event, EngineError):
            self.done = True
            self.timing.end("error")
            raise ApiError.from_engine(event)
        self.done = event.finished
        if event.finished:
            self.timing.end("finished")
        return event.finished

    def close(self) -> None:
        """Cancel the request down the chain (router -> engine abort) unless it finished; a direct stream also
        aborts on its replica (in case its call never started there) and is released at the router. A stream
        ended by `end` is aborted too: the engine still runs it."""
        if self.engines is not None:
            self.engines.live.discard(self)
        if not self.done or (self._ended is not None and not self._aborted) or self._owes_abort:
            if not self.done:
                self.done = True
                self.timing.end("abort")
            self._aborted, self._owes_abort = True, False
            self.gen.cancel()
            if self.started is not None:
                self.engines.abort(self.started, after=self.start_call)
        if self.engines is not None and not self._released:
            # also when no redirect came: the router may have held the request before we stopped listening
            # (a release of a request it does not hold changes nothing)
            self._released = True
            self.engines.release(self.request_id)


async def interleave(streams: list[Stream]) -> AsyncIterator[tuple[int, EngineChunk]]:
    """Chunks of several requests (one per prompt) as they arrive, tagged with the prompt index (not merged:
    `chunks.merge_chunks` is what joins one request's chunks). Leaving early (client gone) cancels every request
    still running."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0].chunks():
                yield 0, chunk
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(p: int, stream: Stream) -> None:
        try:
            async for chunk in stream.chunks():
                await queue.put((p, chunk))
        except Exception as e:  # handed to the consumer, which re-raises
            await queue.put((p, e))
        finally:
            await queue.put((p, done_marker))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            p, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE body that never dies mid-flight with a trace: a failure becomes an OpenAI error event + [DONE]."""
    try:
        async for event in events:
            yield event
    except ApiError as e:
        yield sse_event(e.body())
        yield SSE_DONE
    except Exception as e:  # an engine replica (or the router) died mid-stream: retryable, as without streaming
        logger.error("stream failed: %r", e)
        yield sse_event(ApiError(503, f"engine failed mid-request ({type(e).__name__}); retry",
                                 code="engine_unavailable").body())
        yield SSE_DONE


class SSEResponse(StreamingResponse):
    """An SSE response that closes its streams however it ends: a client gone before the body started leaves the
    body generator unstarted (its own cleanup never runs), and each stream still owes its engine an abort and the
    router a release."""

    def __init__(self, body: AsyncIterator[str], streams: list[Stream]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()
