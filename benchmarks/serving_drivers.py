"""How benchmarks/bench_serving_pd.py sends a phase's requests and times them: through the HTTP stack (`http_driver`:
SSE completions on aiohttp, each chunk timed on arrival as `deploy.bench` times it, with its token count and the
engine request id kept for benchmarks/serving_trace.py) or straight into an `AsyncEngine` in this process
(`inproc_driver`: the same workload with nothing in between). Both return a `StreamsRun`; `client_trace` turns its
results into the compact trace serving_trace reads.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from deploy.bench import RequestResult


@dataclass
class StreamsRun:
    """One phase as the client saw it: results in request order, the short stream's duration, and the run's
    start on both clocks (perf_counter for the results' times, time.time() for the replicas' timelines)."""

    short: list
    long: list
    duration: float
    perf0: float
    wall0: float


@dataclass(kw_only=True)
class TracedResult(RequestResult):
    """What locating a stall needs beyond deploy.bench's result: the engine request id and each chunk's tokens."""

    chunk_tokens: list[int] = field(default_factory=list)
    request_id: str | None = None  # the engine's id (the ingress's response id + "-0")


def http_driver(base_url: str, concurrency: int):
    async def drive(short: list, long: list, long_at: list[float], request_timeout_s: float) -> StreamsRun:
        return await run_streams(base_url, short, long, long_at, concurrency=concurrency,
                                 request_timeout_s=request_timeout_s)
    return drive


async def run_streams(base_url: str, short: list, long: list, long_at: list[float], *, concurrency: int,
                      request_timeout_s: float) -> StreamsRun:
    """The short stream (at most `concurrency` in flight, as `deploy.bench.run_benchmark` sends it) and, beside it,
    each long request sent at its offset from the start; every request traced (`send_traced`)."""
    import aiohttp

    from deploy.bench import build_payload

    endpoint = "/v1/completions"
    url = base_url + endpoint
    model = await _model_name(base_url)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    def payload(req) -> dict:
        # return_token_ids: each chunk says how many tokens it carries (a late chunk may bring several)
        return build_payload(req, model=model, endpoint=endpoint, stream=True, ignore_eos=True,
                             extra_body={"return_token_ids": True})

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as ss, \
            aiohttp.ClientSession(timeout=timeout) as ls:
        sem = asyncio.Semaphore(concurrency)

        async def one_short(req) -> TracedResult:
            async with sem:
                return await send_traced(ss, url, req, payload(req))

        async def shorts() -> tuple[list, float]:
            res = await asyncio.gather(*(one_short(r) for r in short))
            return list(res), time.perf_counter() - perf0

        async def one_long(req, at: float) -> TracedResult:
            await asyncio.sleep(max(0.0, perf0 + at - time.perf_counter()))
            return await send_traced(ls, url, req, payload(req))

        perf0, wall0 = time.perf_counter(), time.time()
        short_task = asyncio.ensure_future(shorts())
        long_results = list(await asyncio.gather(*(one_long(r, at) for r, at in zip(long, long_at))))
        short_results, duration = await short_task
    return StreamsRun(short=short_results, long=long_results, duration=duration, perf0=perf0, wall0=wall0)


async def send_traced(session: Any, url: str, req: Any, payload: dict) -> TracedResult:
    """One SSE completion, measured as `deploy.bench.send_request` measures it (perf_counter on arrival of each
    chunk with output), keeping the response id and each chunk's token count as well."""
    from deploy.bench import _chunk_output  # the same "chunk carries output" rule as the shared client

    res = TracedResult(prompt_tokens=req.input_len)
    res.start = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                res.end = time.perf_counter()
                return res
            buf = b""
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                buf += raw
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    _take_event(res, line.strip(), now, _chunk_output)
                res.end = now
        res.output_tokens = res.output_tokens or sum(res.chunk_tokens)
        res.success = bool(res.chunk_times)
        if not res.success:
            res.error = "no output"
    except Exception as e:  # the benchmark reports failures; it does not stop on them
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"
    return res


def _take_event(res: TracedResult, line: bytes, now: float, chunk_output) -> None:
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return
    event = json.loads(line[5:].strip())
    if "error" in event:
        raise RuntimeError(f"stream error: {event['error']}")
    if res.request_id is None and event.get("id"):
        res.request_id = f"{event['id']}-0"  # deploy/ingress.py: engine request id = response id + prompt index
    if chunk_output(event) is not None:
        res.chunk_times.append(now)
        res.chunk_tokens.append(sum(len(c.get("token_ids") or ()) for c in event.get("choices") or ()) or 1)
    if event.get("usage"):
        res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
        res.prompt_tokens = int(event["usage"].get("prompt_tokens") or res.prompt_tokens)


def inproc_driver(engine: Any, concurrency: int):
    """The same workload through `engine` (an AsyncEngine) on this event loop: greedy, ignore_eos, fixed length,
    as the ingress builds it; a chunk = an output with new tokens, timed when this loop receives it."""
    phase = itertools.count()

    async def drive(short: list, long: list, long_at: list[float], request_timeout_s: float) -> StreamsRun:
        tag = f"inproc{next(phase)}"
        sem = asyncio.Semaphore(concurrency)

        async def one_short(i: int, req) -> TracedResult:
            async with sem:
                return await _inproc_request(engine, f"{tag}-s{i}", req, request_timeout_s)

        async def shorts() -> tuple[list, float]:
            res = await asyncio.gather(*(one_short(i, r) for i, r in enumerate(short)))
            return list(res), time.perf_counter() - perf0

        async def one_long(i: int, req, at: float) -> TracedResult:
            await asyncio.sleep(max(0.0, perf0 + at - time.perf_counter()))
            return await _inproc_request(engine, f"{tag}-l{i}", req, request_timeout_s)

        perf0, wall0 = time.perf_counter(), time.time()
        short_task = asyncio.ensure_future(shorts())
        long_results = list(await asyncio.gather(*(one_long(i, r, at) for i, (r, at) in enumerate(zip(long, long_at)))))
        short_results, duration = await short_task
        return StreamsRun(short=short_results, long=long_results, duration=duration, perf0=perf0, wall0=wall0)
    return drive


async def _inproc_request(engine: Any, rid: str, req: Any, timeout_s: float) -> TracedResult:
    from workers.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=req.output_len, min_tokens=req.output_len, ignore_eos=True)
    res = TracedResult(prompt_tokens=req.input_len, request_id=rid)
    res.start = time.perf_counter()

    async def consume() -> None:
        seen = 0
        async for out in engine.generate(rid, req.prompt, params):
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n > seen:
                res.chunk_times.append(now)
                res.chunk_tokens.append(n - seen)
                seen = n
            res.end = now
        res.output_tokens = seen

    try:
        await asyncio.wait_for(consume(), timeout_s)  # leaving the stream early aborts the request
        res.success = bool(res.chunk_times)
    except Exception as e:
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"
    return res


def client_trace(results: list, perf0: float) -> list[dict]:
    """Each request's times relative to the run start (seconds, 10 us resolution), for serving_trace."""
    rel = lambda t: round(t - perf0, 5)  # noqa: E731
    return [{"id": r.request_id, "ok": r.success, "start": rel(r.start), "end": rel(r.end),
             "t": [rel(t) for t in r.chunk_times], "n": list(r.chunk_tokens), "out": r.output_tokens}
            for r in results]


async def _model_name(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(base_url + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
