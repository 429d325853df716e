"""The chaos run's load and its verdicts (tests/deploy/test_chaos.py): client threads that send a bounded mixed load
(chat and completions, streaming and not, short and long, some hanging up early) until a deadline, and the
classification of how each request ended.

A request may end in one of these ways, and only these (anything else is `bad`):
- `ok`: 200 with all its tokens (streams: chunks, a `finish_reason`, then `[DONE]`);
- `retryable`: a 503 (or 429) OpenAI error with `Retry-After`, or, once a stream has started, one error event
  with such a code followed by `[DONE]`;
- `hung_up`: the client left on purpose (after 0, 1 or 3 stream events, or before a non-streamed answer);
- `cut`: the connection broke, or Serve's proxy answered a bare `500 Internal Server Error` (not our JSON), while
  an ingress replica died: the HTTP server that held the request is gone, and Ray Serve's proxy turns an
  ingress actor's death into exactly that (ray/serve/_private/http_util.py: only 408/429/503 get a body). Counted
  `bad` if no ingress kill overlapped the request.
"""
from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

# Codes a client may see while a replica dies or restarts (docs/operations.md, the error table): retry them.
RETRYABLE_CODES = {"engine_unavailable", "kv_transfer_failed", "kv_unwired", "not_ready", "kv_capacity",
                   "queue_full"}
HANG_BOUND_S = 120.0  # no request may take longer than this to end, whatever happened to its replicas
SHORT, LONG = 8, 64  # max_tokens of a short and a long request
OUTCOMES = ("ok", "retryable", "hung_up", "cut", "bad")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@dataclass(frozen=True)
class Spec:
    """One request the load sends."""

    chat: bool
    stream: bool
    max_tokens: int
    hangup_after: int | None  # streams: leave after this many events; non-streamed: leave after hangup_s
    hangup_s: float | None
    prompt: tuple[int, ...] | str

    @property
    def hangs_up(self) -> bool:
        return self.hangup_s is not None or self.hangup_after is not None

    @property
    def kind(self) -> str:
        return (f"{'chat' if self.chat else 'cmpl'}/{'stream' if self.stream else 'plain'}/"
                f"{'long' if self.max_tokens == LONG else 'short'}{'/hangup' if self.hangs_up else ''}")


@dataclass
class Result:
    spec: Spec
    start: float
    end: float = 0.0
    outcome: str = "bad"
    status: int | None = None
    detail: str = ""


def random_spec(rng: random.Random) -> Spec:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    max_tokens = LONG if rng.random() < 0.3 else SHORT
    hangup_after = hangup_s = None
    if rng.random() < 0.2:
        if stream:
            hangup_after = rng.choice((0, 1, 3))
        else:
            hangup_s = rng.uniform(0.2, 1.5)
    if chat:
        prompt: tuple[int, ...] | str = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 30)))
    else:
        prompt = tuple(rng.randrange(3, 384) for _ in range(rng.randrange(4, 60)))
    return Spec(chat=chat, stream=stream, max_tokens=max_tokens, hangup_after=hangup_after, hangup_s=hangup_s,
                prompt=prompt)


def _body(spec: Spec, model: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0, "ignore_eos": True,
              "stream": spec.stream}
    if spec.chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": spec.prompt}]}
    return "/v1/completions", {**common, "prompt": list(spec.prompt)}


def _error_of(text: str) -> dict | None:
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


def _judge_error(res: Result, err: dict | None, retry_after: str | None, *, in_stream: bool) -> None:
    if err is None:
        res.outcome, res.detail = "cut", f"{res.status} without our JSON error"
        return
    ok = err.get("code") in RETRYABLE_CODES and err.get("type") != "internal_error"
    ok = ok and (in_stream or (res.status in (429, 503) and retry_after is not None))
    res.outcome = "retryable" if ok else "bad"
    res.detail = f"{err.get('code')}: {str(err.get('message'))[:120]}"


def _plain(client: httpx.Client, url: str, body: dict, headers: dict, spec: Spec, res: Result) -> None:
    timeout = httpx.Timeout(HANG_BOUND_S, connect=10.0) if spec.hangup_s is None else spec.hangup_s
    try:
        r = client.post(url, json=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        if spec.hangup_s is not None:
            res.outcome = "hung_up"
            return
        res.outcome, res.detail = "bad", f"no answer within {HANG_BOUND_S} s"
        return
    res.status = r.status_code
    if r.status_code == 200:
        got = r.json()["usage"]["completion_tokens"]
        res.outcome = "ok" if got == spec.max_tokens else "bad"
        res.detail = f"{got} tokens"
        return
    _judge_error(res, _error_of(r.text), r.headers.get("retry-after"), in_stream=False)


def _streamed(client: httpx.Client, url: str, body: dict, headers: dict, spec: Spec, res: Result) -> None:
    events: list = []
    with client.stream("POST", url, json=body, headers=headers,
                       timeout=httpx.Timeout(HANG_BOUND_S, connect=10.0)) as r:
        res.status = r.status_code
        if r.status_code != 200:
            _judge_error(res, _error_of(r.read().decode(errors="replace")), r.headers.get("retry-after"),
                         in_stream=False)
            return
        if spec.hangup_after == 0:
            res.outcome = "hung_up"
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if spec.hangup_after is not None and len(events) >= spec.hangup_after and data != "[DONE]":
                res.outcome = "hung_up"
                return
    if not events or events[-1] != "[DONE]":
        res.outcome, res.detail = "cut", f"stream ended without [DONE] after {len(events)} events"
        return
    last = events[-2] if len(events) > 1 else {}
    if "error" in last:
        _judge_error(res, last["error"], None, in_stream=True)
        return
    finishes = [c.get("finish_reason") for e in events[:-1] for c in e.get("choices", []) if c.get("finish_reason")]
    res.outcome = "ok" if finishes == ["length"] else "bad"
    res.detail = f"finish {finishes}"


def send(base: str, headers: dict, model: str, spec: Spec) -> Result:
    """One request, to its end; never raises."""
    path, body = _body(spec, model)
    res = Result(spec=spec, start=time.monotonic())
    try:
        with httpx.Client() as client:
            (_streamed if spec.stream else _plain)(client, base + path, body, headers, spec, res)
    except httpx.TimeoutException:
        res.outcome, res.detail = "bad", f"hang: no event within {HANG_BOUND_S} s"
    except httpx.HTTPError as e:  # the connection broke (an ingress replica died under it)
        res.outcome, res.detail = "cut", type(e).__name__
    except Exception as e:  # noqa: BLE001 - a verdict, not a crash of the load
        res.outcome, res.detail = "bad", f"{type(e).__name__}: {e}"
    res.end = time.monotonic()
    return res


@dataclass
class Load:
    """`clients` threads, each sending one request after another until `deadline` (monotonic)."""

    base: str
    headers: dict
    model: str
    seed: int
    clients: int
    deadline: float
    results: list[Result] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while time.monotonic() < self.deadline:
            res = send(self.base, self.headers, self.model, random_spec(rng))
            with self._lock:
                self.results.append(res)
            if res.outcome in ("retryable", "cut"):
                time.sleep(rng.uniform(0.5, 1.5))  # as a client honouring Retry-After would, roughly

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"chaos-client-{i}")
                   for i in range(self.clients)]
        for t in threads:
            t.start()
        return threads


def summary(results: list[Result], kills: list[dict]) -> str:
    """The table the run prints: requests by outcome and kind, kills by role with their recovery times."""
    lines = ["requests by outcome:"]
    by_outcome = Counter(r.outcome for r in results)
    for outcome in OUTCOMES:
        lines.append(f"  {outcome:<10} {by_outcome.get(outcome, 0):>5}")
    lines.append(f"  {'total':<10} {len(results):>5}")
    lines.append("requests by kind (ok/retryable/hung_up/cut/bad):")
    kinds: dict[str, Counter] = {}
    for r in results:
        kinds.setdefault(r.spec.kind, Counter())[r.outcome] += 1
    for kind in sorted(kinds):
        c = kinds[kind]
        lines.append(f"  {kind:<26} " + "/".join(str(c.get(o, 0)) for o in OUTCOMES))
    codes = Counter(r.detail.split(":")[0] for r in results if r.outcome in ("retryable", "cut"))
    lines.append("retryable and cut, by code: " + ", ".join(f"{k} {v}" for k, v in codes.most_common()))
    messages = Counter(r.detail for r in results if r.outcome in ("retryable", "cut"))
    lines += [f"  {n:>4} x {m}" for m, n in messages.most_common(8)]
    lines.append("kills (role, at s, pid, recovered after s; then the retryable/cut requests that ended after it and"
                 " before the next: count, codes, how many had started after it recovered):")
    done = [k for k in kills if k.get("t") is not None]
    for i, k in enumerate(kills):
        rec = "-" if k.get("recovered_s") is None else f"{k['recovered_s']:.1f}"
        line = f"  {k['role']:<8} {k['at_s']:>6.1f} {k.get('pid', '-')!s:>8} {rec:>8}  {k.get('note', '')}"
        if k in done:
            later = [d["t"] for d in done if d["t"] > k["t"]]
            until = min(later, default=float("inf"))
            errs = [r for r in results if r.outcome in ("retryable", "cut") and k["t"] <= r.end < until]
            after = [r for r in errs if k.get("t_back") is not None and r.start > k["t_back"]]
            codes = Counter(r.detail.split(":")[0] for r in errs)
            line += f"  {len(errs)} ({', '.join(f'{c} {n}' for c, n in codes.most_common())}); {len(after)} after"
        lines.append(line)
    by_role = Counter(k["role"] for k in kills if k.get("pid"))
    lines.append("kills by role: " + ", ".join(f"{r} {n}" for r, n in sorted(by_role.items())))
    return "\n".join(lines)
