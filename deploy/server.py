"""EngineServer: the Serve deployment that owns one engine (one model instance, one worker group).

The engine loads in a background thread so the replica comes up at once and reports `loading` until the
weights are in; the ingress answers 503 until every engine is ready (and keeps answering 503, with the reason,
if a load failed). `generate` turns the engine's cumulative outputs into deltas, so what crosses the Serve hop per
step is the new token ids only (the ingress makes the text, and sends `stop` when it finds a stop string), and turns refusals (bad request, queue full) into `EngineError` events instead of
exceptions: an exception crossing Ray loses its type in ways the ingress should not have to guess at.

Roles (docs/disaggregation.md): a `unified` replica serves `generate`. A `prefill` replica serves `prefill`:
the first token (as an `EngineChunk`), then a `TransferOutcome` once the request's KV reached the decode
replica; with attention DP it first answers `place` (the dp rank whose shards will send the KV). A `decode`
replica serves `admit` (reserve pages and say where prefill sends the KV: with attention DP, the admitting dp
rank's sub-group; refusal = an `EngineError`), starts decoding when the KV lands, and serves `decode` (the
stream after the first token, attached whenever it comes) and `fail_remote` (the prefill side failed to send).
The router opens the KV pairs through `kv_listen` / `kv_connect`. Admission, placement and the pair calls are
`KVSide`'s (deploy/server_pd.py), a mixin of this class.

Streaming to the ingress (deploy/stream/, this replica's half in engine_side.py): `generate` and `decode` are
per-request streams. The ingress instead holds one `subscribe` stream per engine replica and starts each request
with `start(subscriber, "generate" | "decode", args)`; every item of the subscription carries all its requests' new
events at once (first events included), so the Serve cost per step does not grow with the batch.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import AsyncIterator

from ray import serve

from deploy.config import ServeConfig
from deploy.gc_pauses import GcPauses, freeze_loaded_heap
from deploy.protocol import EngineChunk, EngineError, EngineEvent, EngineRequest, param_of
from deploy.server_pd import RETRY_AFTER_KV_S, FirstToken, KVSide, TransferOutcome
from deploy.stream.engine_side import DeltaTracker, Publisher
from workers.config import Role
from workers.stats import EngineStats, RequestStats

logger = logging.getLogger("m3serve.server")

RETRY_AFTER_QUEUE_FULL_S = 1.0
RETRY_AFTER_OOM_S = 1.0  # a step that ran out of memory: with less load beside it the request may fit
SERVE_MARKS = 100_000  # (time, request id, kind, tokens) kept for debug_timeline: ~1 per token streamed


def step_error(e) -> EngineError:
    """A `StepFailedError` (a step that ran the request failed; the engine serves on) as the client's answer:
    503 with Retry-After when the step ran out of memory (with less load beside it the request may fit), else
    500."""
    if e.out_of_memory:
        return EngineError(status=503, message=str(e), code="out_of_memory", retry_after=RETRY_AFTER_OOM_S)
    return EngineError(status=500, message=str(e), code="step_failed")


def resolve_model_dir(config: ServeConfig) -> Path:
    """The checkpoint directory to serve: `config.model`, else the built-in tiny model (written on first use)."""
    if config.model is not None:
        path = Path(config.model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model: no such directory: {path}")
        return path.resolve()
    from workers.models import tiny_model_dir

    return Path(tiny_model_dir())


class _TransferCounting:
    """The engine as the metrics reporter sees it, keeping totals of the transfer stats that pass through."""

    def __init__(self, engine, totals: dict) -> None:
        self._engine, self._totals = engine, totals

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def pop_transfer_stats(self) -> list:
        out = self._engine.pop_transfer_stats()
        for t in out:
            self._totals["transfers"] += 1
            self._totals["failed"] += not t.ok
            self._totals["bytes"] += t.num_bytes
            self._totals["seconds"] += t.seconds
        return out


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=10)
class EngineServer(KVSide):
    """One engine replica of a role (`unified`, `prefill` or `decode`): loading, its request streams (`generate`,
    `prefill`, `decode` and the ingress's subscriptions), aborts and stats; the decode side's admission and the
    KV pair calls are `KVSide`'s (deploy/server_pd.py)."""

    def __init__(self, config: ServeConfig, model_dir: str, role: Role = "unified", index: int = 0,
                 model_name: str = "") -> None:
        self._config = config
        self._model_dir = model_dir
        self._model_name = model_name or Path(model_dir).name
        self._reporter = None  # deploy.metrics.EngineReporter: reads the engine's stats for the metrics
        self._exporter = None  # deploy.metrics_exporter.ExporterClient: records them (an actor of its own)
        self._role = role
        self._index = index
        # who this replica is: a restarted one (same name, new process) has a new id, and the router re-wires
        # the KV pairs of a replica whose id changed (its pairs died with the old process)
        self._instance = uuid.uuid4().hex[:12]
        self._engine = None  # workers.async_engine.AsyncEngine once loaded
        self._state = "loading"
        self._error: str | None = None
        self._died = False  # the engine ran, then its step thread failed: Serve should replace this replica
        self._load_started = time.monotonic()
        self._load_seconds: float | None = None
        # Request outcomes as this server saw them (operators' view of cancellations; the leak tests use it).
        self._counters = {"started": 0, "finished": 0, "aborted": 0, "rejected": 0, "failed": 0}
        # KV transfers the metrics reporter recorded (prefill side: one per transfer)
        self._transfer_totals = {"transfers": 0, "failed": 0, "bytes": 0, "seconds": 0.0}
        self._dp_admissions: dict[int, int] = {}  # attention DP: requests admitted (decode) / placed per dp rank
        # When each event left this replica for the router (time.time(): the client's and the engines' clock):
        # kind "chunk" (with its token count), "outcome" (prefill's transfer result), "decode" (the router's
        # decode call arrived), "arrive" (a unified generate call arrived). Serve hop = client arrival - chunk;
        # see debug_timeline.
        self._serve_marks: deque[tuple] = deque(maxlen=SERVE_MARKS)
        self._subscriptions = Publisher()  # one stream per ingress replica for all the requests it started here
        # decode: what the prefill answered instead of sending the KV, for the request's stream (fail_remote)
        self._answers: dict[str, EngineEvent] = {}
        self._gc_pauses = GcPauses().install()  # for debug_timeline: a slow step beside a collection
        self._thread = threading.Thread(target=self._load, name=f"load-{role}-{index}", daemon=True)
        self._thread.start()

    # -- loading --------------------------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            from workers.async_engine import AsyncEngine
            from workers.engine import make_engine
            from workers.executor.ray_group import GroupOptions

            model_dir = Path(self._model_dir)
            if not model_dir.is_dir() and self._config.model is None:
                # Another node of the cluster: write the built-in tiny model here too (deterministic seed).
                model_dir = resolve_model_dir(self._config)
            group = self._config.groups()[self._role]

            transfer = self._config.transfer if self._role != "unified" else None

            # a group of several shards reserves the Ray CPUs per shard that the serve config asks for
            executor = (GroupOptions(num_cpus_per_shard=group.num_cpus_per_shard)
                        if group.parallel.world_size > 1 else "auto")

            def build_engine():
                return make_engine(str(model_dir), engine_config=self._config.engine_for(self._role),
                                   parallel=group.parallel,
                                   device=self._config.device, role=self._role, transfer=transfer,
                                   executor=executor)

            self._engine = AsyncEngine(build_engine)
            self._start_metrics()
            freeze_loaded_heap()  # collections skip the loaded heap from here on (deploy/gc_pauses.py)
            self._state = "ready"
            self._load_seconds = time.monotonic() - self._load_started
            logger.info("engine %s-%d ready in %.1f s", self._role, self._index, self._load_seconds)
        except Exception as e:  # reported through ready(); the replica stays up to say why
            logger.exception("engine %s-%d failed to load", self._role, self._index)
            self._state = "failed"
            self._error = f"{type(e).__name__}: {e}"

    def _start_metrics(self) -> None:
        try:
            from deploy.metrics import EngineReporter
            from deploy.metrics_exporter import start_exporter

            self._exporter = start_exporter(self._model_name, self._role, self._index)
            # M3SERVE_METRICS_INTERVAL_S: how often the engine's stats feed the metrics (default 0.5 s; Ray forgets a
            # gauge not re-set within ~2 s, so keep it under that)
            interval = float(os.environ.get("M3SERVE_METRICS_INTERVAL_S") or 0.5)
            self._reporter = EngineReporter(_TransferCounting(self._engine, self._transfer_totals), self._exporter,
                                            interval_s=interval).start()
        except Exception:  # metrics must never keep the engine from serving
            logger.exception("engine %s-%d: metrics reporter failed to start", self._role, self._index)

    def check_health(self) -> None:
        """Serve's periodic probe. A replica whose engine died after loading is replaced (a fresh load may
        well work); one whose load failed stays, answering 503 with the reason, instead of crash-looping."""
        if self._died:
            raise RuntimeError(f"engine died: {self._error}")

    async def metrics_families(self) -> list:
        """This replica's series as the API port's /metrics names them (deploy/metrics_endpoint.py)."""
        return [] if self._exporter is None else await self._exporter.families()

    async def ready(self) -> dict:
        """Load state for /health and the CLI's progress display."""
        return {
            "role": self._role,
            "replica": self._index,
            "instance": self._instance,
            "state": self._state,
            "error": self._error,
            "ready": self._state == "ready",
            "seconds": self._load_seconds if self._load_seconds is not None
            else time.monotonic() - self._load_started,
            "max_model_len": self._max_model_len(),
        }

    # -- requests -------------------------------------------------------------------------------------------
    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineEvent]:
        """Stream one request: `EngineChunk`s as tokens appear, or a single `EngineError`."""
        self._serve_marks.append((time.time(), req.request_id, "arrive", 0))  # Serve hops in: client -> here
        if self._engine is None:
            yield self._not_ready()
            return
        from workers.async_engine import QueueFullError

        def error_for(e: Exception) -> EngineError | None:
            if isinstance(e, QueueFullError):
                return EngineError(status=429, message=str(e) or "the waiting queue is full; retry later",
                                   code="queue_full", retry_after=RETRY_AFTER_QUEUE_FULL_S)
            if isinstance(e, ValueError):
                return EngineError(status=400, message=str(e), param=param_of(str(e)))
            return None

        outputs = self._engine.generate(req.request_id, req.prompt_token_ids, req.params, prompt=req.prompt)
        stream = self._stream(req.request_id, outputs, DeltaTracker(), error_for)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def _stream(self, request_id: str, outputs, tracker: DeltaTracker,
                      error_for) -> AsyncIterator[EngineEvent]:
        """The deltas of one engine stream. `error_for(exc)` maps an engine exception to what the client sees
        (None: not an answer we give, re-raise); a dead step thread fails the replica. Closing the stream early
        aborts the request in the engine and frees its pages (client gone, or cancelled by Serve when the HTTP
        client disconnected); the explicit abort covers an iterator never started."""
        from workers.async_engine import EngineDeadError
        from workers.request import StepFailedError

        self._counters["started"] += 1
        finished = refused = failed = False
        try:
            async for out in outputs:
                chunk = tracker.chunk(out)
                if chunk is not None:
                    finished = chunk.finished
                    self._mark_chunk(request_id, chunk)
                    yield chunk
        except Exception as e:  # noqa: BLE001 - mapped to an answer below, or re-raised
            if isinstance(e, EngineDeadError):  # this replica serves nothing more until Serve restarts it
                self._state, self._error, self._died = "failed", str(e), True
                error = EngineError(status=503, message=f"engine failed: {e}", code="engine_failed")
            elif isinstance(e, StepFailedError):  # the engine ended it and serves on
                error, failed = step_error(e), True
            else:
                error = error_for(e)
            if error is None:
                raise
            if isinstance(error, EngineChunk):  # another replica's answer ends it (decode: the prefill's)
                finished = error.finished
            else:
                refused = True
            yield error
        finally:
            await outputs.aclose()
            if not finished and not refused:
                self._engine.abort(request_id)
            self._counters["finished" if finished else "failed" if failed else "rejected" if refused
                           else "aborted"] += 1

    async def stop(self, request_id: str, index: int, stop: str) -> None:
        """The ingress found stop string `stop` in sample `index`'s text: the engine finishes that sample with
        reason "stop" before its next step (the request ends, its pages freed, once every sample finished)."""
        if self._engine is not None:
            self._engine.stop(request_id, index, stop)

    async def abort(self, request_id: str) -> None:
        self._subscriptions.cancel(request_id)  # a subscribed request: its stream aborts as it closes
        if self._engine is not None:
            self._engine.abort(request_id)

    # -- subscriptions: one stream per ingress replica for all its requests ------------------------------------
    async def subscribe(self, subscriber: str) -> AsyncIterator[list[tuple[str, EngineEvent]]]:
        """The events of every request `subscriber` (an ingress replica) started here with `start`, as one stream:
        each item holds what all of them produced since the previous item ((request id, event) pairs, a request's
        chunks merged). One Serve item per step for the whole batch instead of one per request and token: every
        item costs both processes CPU (and this one's step thread the GIL), so per-request streams did not keep
        up with 16 streams of an H200 decode. The first item is empty: from then on `start` may name
        `subscriber`. Ending the subscription (the subscriber left) aborts its requests."""
        subscription = self._subscriptions.serve(subscriber)
        try:
            async for item in subscription:
                yield item
        finally:
            await subscription.aclose()  # now, not when collected: its requests are aborted as it closes

    async def start(self, subscriber: str, method: str, args: tuple) -> EngineError | None:
        """Start a request whose stream is this server's `method(*args)` ("generate" or "decode"); every event of
        it, the first included, goes through `subscriber`'s subscription. Returns None once it is started, or
        the refusal when this replica has no subscription of `subscriber` (it restarted since). Why the first
        event does not come back as this call's answer: on 2 x H200 a unary answer reached the ingress 17-19 ms
        after it left, a subscription item ~7 ms."""
        if not self._subscriptions.serves(subscriber):  # this replica restarted since the subscriber subscribed
            return EngineError(status=503, message=f"engine replica {self._role}-{self._index} lost the stream to "
                                                   f"this ingress; retry", code="engine_unavailable", retry_after=1.0)
        if method not in ("generate", "decode"):
            raise ValueError(f"method: {method!r} is not a stream of this server")
        self._subscriptions.start(subscriber, args[0].request_id, getattr(self, method)(*args))
        return None

    # -- disaggregation: the prefill and decode streams (admission and KV pairs: deploy/server_pd.py) ---------
    async def prefill(self, req: EngineRequest, decode_group: str,
                      transfer_id: str | None = None) -> AsyncIterator[EngineChunk | EngineError | TransferOutcome]:
        """Run the prompt and stream the first token; if the request goes on, its KV is sent to `decode_group`
        (which admitted it under `transfer_id`) and a `TransferOutcome` follows once that settled."""
        if self._engine is None:
            yield self._not_ready()
            return
        if not self._wired(decode_group):
            self._counters["rejected"] += 1
            yield self._unwired(decode_group)
            return
        from workers.async_engine import EngineDeadError, QueueFullError
        from workers.request import StepFailedError

        tracker = DeltaTracker()
        outputs = self._engine.generate(req.request_id, req.prompt_token_ids, req.params, prompt=req.prompt,
                                        handoff_to=decode_group, transfer_id=transfer_id)
        self._counters["started"] += 1
        handed_off = settled = refused = failed = False
        try:
            async for out in outputs:
                handed_off = out.finished and out.outputs[0].finish_reason is None
                chunk = tracker.chunk(out)
                if chunk is not None:
                    chunk.finished = chunk.finished and not handed_off  # the decode replica goes on
                    self._mark_chunk(req.request_id, chunk)
                    yield chunk
            if handed_off:
                t = self._config.transfer
                ok, reason = await self._engine.transfer_outcome(req.request_id, t.lease_s + t.timeout_s)
                settled = True
                self._serve_marks.append((time.time(), req.request_id, "outcome", 0))
                yield TransferOutcome(ok=ok, reason=reason)
        except QueueFullError as e:
            refused = True
            yield EngineError(status=429, message=str(e) or "the waiting queue is full; retry later",
                              code="queue_full", retry_after=RETRY_AFTER_QUEUE_FULL_S)
        except ValueError as e:
            refused = True
            yield EngineError(status=400, message=str(e), param=param_of(str(e)))
        except EngineDeadError as e:
            refused = True
            self._state, self._error, self._died = "failed", str(e), True
            yield EngineError(status=503, message=f"engine failed: {e}", code="engine_failed")
        except StepFailedError as e:  # the engine ended it (its handoff too) and serves on
            refused = failed = True
            yield step_error(e)
        finally:
            await outputs.aclose()
            ended = settled or (not handed_off and tracker.done)
            if not ended and not refused:  # cancelled: the engine frees the pages once the transfer lets go
                self._engine.abort(req.request_id)
            self._counters["finished" if ended else "failed" if failed else "rejected" if refused
                           else "aborted"] += 1

    async def decode(self, req: EngineRequest, first: FirstToken | None) -> AsyncIterator[EngineEvent]:
        """Stream an admitted request after its first token (which the client already has). It may have been
        decoding since its KV landed: the first event then carries every token so far. `first` None: the
        stream opened before the prefill ran, so it carries the first token too (the KV header brings it), and
        the prompt's ids, as a unified stream does; if the prefill answered instead (`fail_remote` with an
        answer: its refusal, or the first token ended the request), that answer is what it yields."""
        if self._engine is None:
            yield self._not_ready()
            return
        from workers.engine import KVTransferFailed

        def error_for(e: Exception) -> EngineEvent | None:
            if isinstance(e, KVTransferFailed):
                answer = self._answers.pop(req.request_id, None)
                if answer is not None:
                    return answer
                return EngineError(status=503, message=f"the request's KV did not reach the decode replica: {e}",
                                   code="kv_transfer_failed", retry_after=RETRY_AFTER_KV_S)
            if isinstance(e, (ValueError, KeyError)):
                return EngineError(status=500, message=f"decode: {e}", code="internal_error")
            return None

        self._serve_marks.append((time.time(), req.request_id, "decode", 0))
        outputs = self._engine.generate_remote(req.request_id, first.token_id if first else None,
                                               first.logprobs if first else None)
        stream = self._stream(req.request_id, outputs, DeltaTracker(first), error_for)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def debug_timeline(self, since: float = 0.0) -> dict:
        """Where this replica's time went since `since` (time.time()): the engine's steps and handoff marks
        (`AsyncEngine.debug_timeline`) plus this server's `serve_marks` (time, request id, kind, tokens) and the
        process's garbage collections (`gc`), for benchmarks (bench_serving_pd.py). Bounded rings: the latest ~20k steps and ~100k events."""
        out = {"role": self._role, "replica": self._index, "steps": [], "marks": [], "now": time.time()}
        if self._engine is not None:
            out.update(self._engine.debug_timeline(since))
        out["serve_marks"] = [m for m in list(self._serve_marks) if m[0] >= since]
        out["gc"] = self._gc_pauses.since(since)  # (time, seconds, generation, collected)
        # the metrics reporter's ticks (wall start, seconds, CPU seconds): its thread shares the GIL with the step
        # thread (the recording itself runs in the exporter's process: deploy/metrics_exporter.py)
        ticks = [] if self._reporter is None else list(self._reporter.ticks)
        out["metrics_ticks"] = [t for t in ticks if t[0] >= since]
        return out

    def _mark_chunk(self, request_id: str, chunk: EngineChunk) -> None:
        self._serve_marks.append((time.time(), request_id, "chunk", sum(len(s.token_ids) for s in chunk.samples)))

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError(f"engine {self._role}-{self._index} is {self._state}: {self._error or 'loading'}")
        return self._engine

    async def stats(self) -> EngineStats:
        if self._engine is None:
            return EngineStats(role=self._role)
        return self._engine.stats()

    async def snapshot(self) -> dict:
        """Engine stats plus this server's request counters (`started`, `finished`, `aborted`, `rejected`)."""
        return {"stats": await self.stats(), "counters": dict(self._counters), "instance": self._instance}

    async def pop_request_stats(self) -> list[RequestStats]:
        # The metrics reporter is the engine's one consumer of finished-request stats; read them from it. Off the
        # event loop: a flush waits for a tick in progress, and the loop streams.
        if self._reporter is not None:
            reporter = self._reporter

            def flush() -> list[RequestStats]:
                reporter.tick()  # include what finished since the last tick
                return reporter.drain_requests()
            return await asyncio.to_thread(flush)
        return [] if self._engine is None else self._engine.pop_request_stats()

    def _max_model_len(self) -> int:
        """The engine's effective limit (it clamps to the model's positions), else the configured one."""
        engine = getattr(self._engine, "engine", None)
        config = getattr(engine, "engine_config", None)
        return config.max_model_len if config is not None else self._config.engine.max_model_len

    def _not_ready(self) -> EngineError:
        if self._state == "failed":
            return EngineError(status=503, message=f"engine failed to load: {self._error}", code="engine_failed")
        return EngineError(status=503, message="engine is loading", code="not_ready", retry_after=5.0)

    def __del__(self) -> None:
        if getattr(self, "_gc_pauses", None) is not None:
            self._gc_pauses.remove()
        if self._reporter is not None:
            try:
                self._reporter.stop(flush=False)
            except Exception:
                pass
        engine = self._engine
        if engine is not None and hasattr(engine, "shutdown"):
            try:
                engine.shutdown()
            except Exception:
                pass

