"""`m3serve bench`: a load generator for any OpenAI-compatible endpoint (ours or another server).

Modeled on `vllm bench serve`: N requests with random or fixed input/output lengths (token-id prompts through
`/v1/completions`, which pins the input length exactly, or text), sent at a Poisson request rate or all at once,
optionally capped at a fixed concurrency, streamed over SSE. It reports request and token throughput, TTFT,
TPOT, ITL and end-to-end latency (mean, median, std, chosen percentiles), goodput under SLOs, as a table and a
JSON result file.

Definitions (per request, times measured on this client with `time.perf_counter()`):
- start: just before the HTTP request is sent; end: when the stream's last event arrived.
- TTFT = time of the first chunk carrying output - start.
- ITL = gaps between consecutive chunks carrying output (one entry per gap; a chunk with several tokens is one).
- TPOT = (end - first output chunk) / (output tokens - 1), for 2+ output tokens.
- e2e = end - start.
Output tokens come from the server's `usage` (requested with `stream_options.include_usage`), else the number
of output chunks. `deploy.metrics.request_observations` uses the same definitions on the engine's timestamps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchRequest", "RequestResult", "make_requests", "summarize", "run_benchmark", "add_arguments", "run"]

MAX_NUM_PROMPTS = 1_000_000
_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact river stone light water cloud field music garden").split()
_SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """One request to send: `prompt` is a token-id list or text; `input_len` is what was asked for."""

    prompt: list[int] | str
    input_len: int
    output_len: int


@dataclass(kw_only=True)
class RequestResult:
    """What one request did, as this client saw it (perf_counter seconds)."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried output
    output_tokens: int = 0
    prompt_tokens: int = 0  # from the server's usage, else the requested input length
    output_text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start


# -- workload ---------------------------------------------------------------------------------------------------
def _lengths(mean: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    """n lengths uniform in [mean*(1-r), mean*(1+r)] (at least 1); r = 0 gives fixed lengths."""
    lo = max(1, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(*, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  prompt_type: str = "tokens", token_id_low: int = 3, token_id_high: int = 256,
                  seed: int = 0) -> list[BenchRequest]:
    """The benchmark's requests, reproducible from `seed`. Text prompts are `input_len` random words."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio: must be in [0, 1)")
    if prompt_type == "tokens" and not 0 <= token_id_low < token_id_high:
        raise ValueError("token_id_low/token_id_high: need 0 <= low < high")
    rng = random.Random(seed)
    ins = _lengths(input_len, range_ratio, num_prompts, rng)
    outs = _lengths(output_len, range_ratio, num_prompts, rng)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        if prompt_type == "tokens":
            prompt: list[int] | str = [rng.randrange(token_id_low, token_id_high) for _ in range(n_in)]
        elif prompt_type == "text":
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        else:
            raise ValueError(f"prompt_type: tokens or text, got {prompt_type!r}")
        reqs.append(BenchRequest(prompt=prompt, input_len=n_in, output_len=n_out))
    return reqs


def arrival_gaps(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential (Poisson process) at `request_rate`; 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(n - 1)]


# -- one request ------------------------------------------------------------------------------------------------
def build_payload(req: BenchRequest, *, model: str, endpoint: str, stream: bool, ignore_eos: bool,
                  extra_body: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": stream}
    if endpoint.endswith("/chat/completions"):
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        # vLLM-style extras that pin the output length; servers without them ignore or reject them
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_len
    body.update(extra_body)
    return body


def _chunk_output(event: dict[str, Any]) -> str | None:
    """The output a streamed event carries (text or content delta), or None for an event without output."""
    for choice in event.get("choices") or ():
        if "delta" in choice:
            piece = (choice.get("delta") or {}).get("content")
        else:
            piece = choice.get("text")
        # A token that decodes to "" (held-back partial UTF-8) is still a token: count chunks with token ids too
        if piece or choice.get("token_ids") or (choice.get("logprobs") or {}).get("tokens"):
            return piece or ""
    return None


async def send_request(session: Any, url: str, req: BenchRequest, payload: dict[str, Any], *,
                       stream: bool, headers: dict[str, str]) -> RequestResult:
    res = RequestResult(prompt_tokens=req.input_len)
    res.start = time.perf_counter()
    usage: dict[str, Any] | None = None
    pieces: list[str] = []
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                res.end = time.perf_counter()
                return res
            if not stream:
                body = await resp.json()
                res.end = time.perf_counter()
                out = _chunk_output(body) or ""
                choice = (body.get("choices") or [{}])[0]
                out = out or (choice.get("message") or {}).get("content") or ""
                res.chunk_times = [res.end]
                pieces.append(out)
                usage = body.get("usage")
            else:
                buf = b""
                async for raw in resp.content.iter_any():
                    now = time.perf_counter()
                    buf += raw
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            raise RuntimeError(f"stream error: {event['error']}")
                        out = _chunk_output(event)
                        if out is not None:
                            res.chunk_times.append(now)
                            pieces.append(out)
                        if event.get("usage"):
                            usage = event["usage"]
                    res.end = now
        res.output_text = "".join(pieces)
        if usage:
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            res.prompt_tokens = int(usage.get("prompt_tokens") or req.input_len)
        else:
            res.output_tokens = len(res.chunk_times)
        res.success = bool(res.chunk_times) or res.output_tokens == 0
        if not res.success:
            res.error = "no output"
    except Exception as e:  # the benchmark reports failures; it does not stop on them
        res.end = time.perf_counter()
        res.error = f"{type(e).__name__}: {e}"
    return res


# -- summary ----------------------------------------------------------------------------------------------------
def _dist(values: list[float], percentiles: list[float], name: str) -> dict[str, float]:
    """mean/median/std/pNN of `values` in ms (0 for an empty list, like vLLM)."""
    ms = [v * 1000.0 for v in values]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = _percentile(ms, p) if ms else 0.0
    return out


def _percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
    for key, limit in slos_ms.items():
        v = values[key]
        if v is not None and v * 1000.0 > limit:
            return False
    return True


def summarize(results: list[RequestResult], duration: float, *, percentiles: list[float],
              slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    s: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": total_in / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    if slos_ms:
        good = sum(1 for r in ok if meets_slos(r, slos_ms))
        s["good_requests"] = good
        s["goodput"] = good / duration if duration > 0 else 0.0
    s.update(_dist([r.ttft for r in ok if r.ttft is not None], percentiles, "ttft"))
    s.update(_dist([r.tpot for r in ok if r.tpot is not None], percentiles, "tpot"))
    s.update(_dist([g for r in ok for g in r.itl], percentiles, "itl"))
    s.update(_dist([r.e2e for r in ok], percentiles, "e2el"))
    return s


def format_table(s: dict[str, Any], percentiles: list[float]) -> str:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    if "goodput" in s:
        rows.append(("Request goodput (req/s)", f"{s['goodput']:.2f}"))
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{:-^60}".format(f" {title} "))
        stats = [("mean", "Mean"), ("median", "Median")] + [(f"p{p:g}", f"P{p:g}") for p in percentiles]
        for key, label in stats:
            lines.append(f"{label + ' ' + name.upper() + ' (ms)':<44}{s[f'{key}_{name}_ms']:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------------------
async def _discover_model(session: Any, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        data = (await resp.json())["data"]
        if not data:
            raise RuntimeError("the server lists no models; pass --model")
        return data[0]["id"]


async def run_benchmark(*, base_url: str, endpoint: str, requests: list[BenchRequest], model: str | None = None,
                        request_rate: float = math.inf, max_concurrency: int | None = None, stream: bool = True,
                        ignore_eos: bool = False, extra_body: dict[str, Any] | None = None,
                        api_key: str | None = None, request_timeout_s: float = 600.0, seed: int = 0,
                        progress: bool = True) -> tuple[list[RequestResult], float, str]:
    """Send `requests`; returns (results in request order, benchmark duration in s, the model name used)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    conn = aiohttp.TCPConnector(limit=max_concurrency or 0)
    url = base_url.rstrip("/") + endpoint
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        if model is None:
            model = await _discover_model(session, base_url, headers)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", file=sys.stderr)

        async def one(req: BenchRequest) -> RequestResult:
            payload = build_payload(req, model=model, endpoint=endpoint, stream=stream, ignore_eos=ignore_eos,
                                    extra_body=extra_body or {})
            if sem is None:
                res = await send_request(session, url, req, payload, stream=stream, headers=headers)
            else:
                async with sem:
                    res = await send_request(session, url, req, payload, stream=stream, headers=headers)
            if bar is not None:
                bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, arrival_gaps(len(requests), request_rate, seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return results, duration, model


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in _SLO_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY in {_SLO_KEYS}, got {item!r}")
        slos[key] = float(value)
        if slos[key] <= 0:
            raise ValueError(f"--goodput: {key} must be > 0 ms")
    return slos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: env OPENAI_API_KEY or M3SERVE_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (mean)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request (mean)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths")
    p.add_argument("--prompt-type", choices=["tokens", "text"], default="tokens",
                   help="token-id prompts (exact input length; /v1/completions) or random-word text")
    p.add_argument("--token-id-range", type=int, nargs=2, default=[3, 256], metavar=("LOW", "HIGH"),
                   help="token ids drawn from [LOW, HIGH) (default: %(default)s; keep HIGH <= the vocab size)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default: inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = e2e, no ITL)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos and min_tokens=max_tokens so every request generates --output-len tokens")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.add_argument("--save-detailed", action="store_true", help="include per-request TTFT/ITL/lengths in the JSON")
    p.add_argument("--disable-tqdm", action="store_true")


def _check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.num_prompts <= MAX_NUM_PROMPTS:
        raise ValueError(f"--num-prompts: must be in [1, {MAX_NUM_PROMPTS}]")
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError("--input-len/--output-len: must be >= 1")
    if args.request_rate <= 0:
        raise ValueError("--request-rate: must be > 0 (inf = all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency: must be >= 1")
    if args.prompt_type == "tokens" and args.endpoint != "/v1/completions":
        raise ValueError("--prompt-type tokens needs --endpoint /v1/completions")


def run(args: argparse.Namespace) -> int:
    import os

    try:
        _check_args(args)
        percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
        slos = parse_slos(args.goodput)
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError("--extra-body: must be a JSON object")
        reqs = make_requests(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                             range_ratio=args.range_ratio, prompt_type=args.prompt_type,
                             token_id_low=args.token_id_range[0], token_id_high=args.token_id_range[1],
                             seed=args.seed)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("M3SERVE_API_KEY")
    results, duration, model = asyncio.run(run_benchmark(
        base_url=args.base_url, endpoint=args.endpoint, requests=reqs, model=args.model,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, stream=not args.no_stream,
        ignore_eos=args.ignore_eos, extra_body=extra, api_key=api_key, request_timeout_s=args.request_timeout,
        seed=args.seed, progress=not args.disable_tqdm))
    summary = summarize(results, duration, percentiles=percentiles, slos_ms=slos)
    print(format_table(summary, percentiles))
    errors = sorted({r.error for r in results if not r.success})
    for err in errors[:5]:
        print(f"error: {err}", file=sys.stderr)
    if args.result_file:
        doc: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "base_url": args.base_url, "endpoint": args.endpoint,
            "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "range_ratio": args.range_ratio, "prompt_type": args.prompt_type,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "max_concurrency": args.max_concurrency, "stream": not args.no_stream, "ignore_eos": args.ignore_eos,
            "goodput_slos_ms": slos, "percentiles": percentiles, **summary, "errors": errors,
        }
        if args.save_detailed:
            doc["requests"] = [{"success": r.success, "error": r.error, "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens, "ttft_s": r.ttft, "tpot_s": r.tpot,
                                "e2e_s": r.e2e, "itl_s": r.itl} for r in results]
        Path(args.result_file).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if summary["completed"] > 0 else 1
