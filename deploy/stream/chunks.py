"""The unit of the ingress <-> engine stream and how it merges: a lagging consumer gets the chunks it missed as one.

Every hop of a stream (EngineServer -> Router -> Ingress -> Serve's HTTP proxy -> client) costs CPU per item, not
per token: a Ray streaming-generator item, a cross-thread hand-off, an SSE event. At one item per token, 16
streams of an H200 decode (~3k tokens/s) saturate a hop, and then every token waits in that hop's queue.
`EngineChunk`s are deltas that concatenate, so whatever piled up while a consumer was busy can travel as one
chunk (as vLLM's output collector merges the outputs a slow API handler did not pick up yet): a consumer that keeps
up still gets one chunk per step, a lagging one gets fewer, larger chunks with the same tokens, text and logprobs.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

from deploy.protocol import EngineChunk, SampleDelta


def merge_chunks(chunks: list[EngineChunk]) -> EngineChunk:
    """One chunk carrying what `chunks` (consecutive deltas of one request, in order) carry together."""
    if len(chunks) == 1:
        return chunks[0]
    samples: dict[int, SampleDelta] = {}
    for chunk in chunks:
        for s in chunk.samples:
            into = samples.get(s.index)
            if into is None:  # a copy: the chunks may be referenced elsewhere (the first is kept by the ingress)
                samples[s.index] = SampleDelta(index=s.index, token_ids=list(s.token_ids), text=s.text,
                                               logprobs=None if s.logprobs is None else list(s.logprobs),
                                               finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            else:
                _append(into, s)
    first = chunks[0]
    prompt = next((c for c in chunks if c.prompt_token_ids is not None), None)
    return EngineChunk(request_id=first.request_id, samples=list(samples.values()),
                       finished=chunks[-1].finished,
                       prompt_token_ids=None if prompt is None else prompt.prompt_token_ids,
                       prompt_logprobs=None if prompt is None else prompt.prompt_logprobs)


def _append(into: SampleDelta, s: SampleDelta) -> None:
    into.token_ids.extend(s.token_ids)
    into.text += s.text
    if s.logprobs is not None:
        into.logprobs = (into.logprobs or []) + list(s.logprobs)
    if s.finish_reason is not None:  # a sample finishes once, in its last delta
        into.finish_reason, into.stop_reason = s.finish_reason, s.stop_reason


def merge_runs(events: Iterable[Any]) -> list[Any]:
    """`events` with every run of consecutive `EngineChunk`s merged; anything else (an error, a transfer outcome)
    stays where it is, so nothing moves past it."""
    out: list[Any] = []
    run: list[EngineChunk] = []
    for e in events:
        if isinstance(e, EngineChunk):
            run.append(e)
            continue
        if run:
            out.append(merge_chunks(run))
            run = []
        out.append(e)
    if run:
        out.append(merge_chunks(run))
    return out


class EventQueue:
    """One request's events as another task hands them over (`put`, or `fail` to end with an error), read as an
    async iterator: everything queued since the reader's previous step, chunks merged (`merge_runs`)."""

    def __init__(self) -> None:
        self._buf: deque = deque()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None

    def put(self, event: Any) -> None:
        self._buf.append(event)
        self._wake.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            if self._buf:
                batch = list(self._buf)
                self._buf.clear()
                for event in merge_runs(batch):
                    yield event
                continue
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()


# Serve knobs for the replicas of this app (env vars, read when a replica process imports Serve). Serve runs a
# replica's user code on a second event loop thread by default, and every item a streaming method yields is handed
# to the replica's main loop with call_soon_threadsafe: the user code never waits for a send, so a backlog of
# unsent items piles up out of its sight and AsyncEngine's newest-only drain has nothing to merge.
# On the replica's own loop, the next item is pulled only once Ray took the previous one, so a lagging hop merges
# what piled up meanwhile (measured, benchmarks/bench_serve_stream.py: 1 -> 2.4 tokens per chunk, half the CPU per
# token in every process, Serve TPOT +200% -> +35% over in-process on 2 cores). Handles are then called from that
# loop too, so their router needs no loop of its own. Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED sets the same two.
# deploy/app.py sets them on the Ingress, Router and EngineServer replicas (docs/benchmarks.md S4, session 16): behind
# HAProxy the Ingress serves HTTP itself (direct ingress), and with user code on its own thread every SSE chunk
# crossed threads on its way to the socket: 132 against 166 ms of Ingress CPU per 1k tokens (medians of 5-6 runs),
# the chunk's hop to the client 3 ms against 9. (A 2026-11-30 GPU run behind Serve's proxy saw no TPOT change.)
REPLICA_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_actor_options(**options: Any) -> dict[str, Any]:
    """`ray_actor_options` for one of this app's deployments: `options` plus `REPLICA_ENV_VARS` in its
    runtime_env (Serve merges a deployment's env_vars into the application's runtime_env)."""
    env = dict(options.pop("runtime_env", None) or {})
    env["env_vars"] = {**REPLICA_ENV_VARS, **env.get("env_vars", {})}
    return {**options, "runtime_env": env}
