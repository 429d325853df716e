"""Where the serving benchmark's time goes: pure analysis of client token traces and engine timelines.

Inputs (plain data, as `bench_serving_pd.py` records them; every time in seconds relative to the phase's run
start `t0`, a `time.time()` taken on the client; engines and client share one host, so one clock):
- a client request: {"id": engine request id, "ok", "start", "end", "t": [arrival of each chunk with output],
  "n": [tokens in each chunk], "out": output tokens}; long prompts also carry "sent_at".
- a replica timeline: `EngineServer.debug_timeline` / `AsyncEngine.debug_timeline` (absolute `time.time()`),
  turned into a `Replica` here: steps (workers/async_engine.STEP_FIELDS), handoff marks (workers/engine.py
  `Engine._mark`) and serve marks (deploy/server.py: when each chunk left the replica).

Nothing here imports torch, ray or the project: it runs on the JSON of a finished run as well.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


# -- small helpers ------------------------------------------------------------------------------------------------
def pctl(values: Sequence[float], p: float) -> float:
    """Percentile by linear interpolation between closest ranks (numpy's default; deploy.bench uses the same)."""
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist_ms(values_s: Iterable[float]) -> dict[str, float]:
    """n, p50/p90/p99/max/mean of seconds, in ms (rounded to 10 us; NaN-free: an empty list gives n 0)."""
    ms = [v * 1e3 for v in values_s if v is not None and not math.isnan(v)]
    if not ms:
        return {"n": 0}
    out = {"n": len(ms)}
    for p in (50, 90, 99):
        out[f"p{p}"] = round(pctl(ms, p), 2)
    out["max"] = round(max(ms), 2)
    out["mean"] = round(sum(ms) / len(ms), 2)
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


# -- client side --------------------------------------------------------------------------------------------------
def token_counts(req: dict) -> list[int]:
    """Tokens carried by each chunk (1 each when the trace did not count them)."""
    return list(req.get("n") or [1] * len(req["t"]))


def cumulative_tokens(req: dict) -> list[int]:
    """Output tokens received once each chunk arrived (the first chunk: usually 1)."""
    out, total = [], 0
    for n in token_counts(req):
        total += n
        out.append(total)
    return out


def chunk_gaps(req: dict) -> list[dict]:
    """Every gap between consecutive chunks: `index` = the token index (0-based) of the first token of the later
    chunk (1 = the first -> second token gap), its length and where it sits on the run's clock."""
    t, cum = req["t"], cumulative_tokens(req)
    return [{"index": cum[j - 1], "gap_s": t[j] - t[j - 1], "from_s": t[j - 1], "to_s": t[j]}
            for j in range(1, len(t))]


def tpot_s(req: dict) -> float | None:
    """Client TPOT as deploy.bench defines it: (end - first chunk) / (output tokens - 1)."""
    if not req.get("ok") or not req["t"] or req.get("out", 0) < 2:
        return None
    return (req["end"] - req["t"][0]) / (req["out"] - 1)


def gap_distributions(reqs: Sequence[dict]) -> dict[str, dict]:
    """The first -> second token gap apart from the later inter-token gaps: in disaggregated serving the first is
    the KV handoff, the others are decode steps."""
    first, later = [], []
    for r in reqs:
        if not r.get("ok"):
            continue
        for g in chunk_gaps(r):
            (first if g["index"] == 1 else later).append(g["gap_s"])
    return {"first_gap_ms": dist_ms(first), "later_itl_ms": dist_ms(later)}


def long_timeline(longs: Sequence[dict], decode: Replica | None = None) -> list[dict]:
    """Each long prompt on the run's clock: sent, first token, finished (and, disaggregated, when its KV landed on
    the decode replica)."""
    out = []
    for i, r in enumerate(longs):
        row = {"i": i, "id": r.get("id"), "ok": r.get("ok"), "sent_s": _r(r.get("start")),
               "first_token_s": _r(r["t"][0] if r["t"] else None), "finish_s": _r(r.get("end"))}
        if decode is not None and r.get("id"):
            landed = decode.landed(r["id"])
            row["kv_landed_s"] = _r(landed)
        out.append(row)
    return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _overlaps(a0: float, a1: float, b0: float | None, b1: float | None) -> bool:
    return b0 is not None and b1 is not None and a0 <= b1 and b0 <= a1


def locate_gap(gap: dict, *, longs: Sequence[dict] = (), replica: Replica | None = None,
               handoff: bool = False) -> dict:
    """One big gap with what overlapped it: long prompts still waiting for their first token (prefilling), long
    prompts whose KV landed on the decode replica, and the steps of the replica that produced the tokens (how
    many, the longest, its prefill tokens): one long step = the engine; no step = host or Serve."""
    a0, a1 = gap["from_s"], gap["to_s"]
    out = {"index": gap["index"], "gap_ms": _ms(gap["gap_s"]), "at_s": _r(a1), "from_s": _r(a0)}
    if handoff and gap["index"] == 1:
        out["handoff"] = True  # first -> second token: prefill replica -> KV transfer -> decode replica
    pre = [i for i, r in enumerate(longs) if r["t"] and _overlaps(a0, a1, r.get("start"), r["t"][0])]
    if pre:
        out["long_prefilling"] = pre
    if replica is not None:
        landed = [i for i, r in enumerate(longs) if r.get("id") and a0 <= (replica.landed(r["id"]) or -1) <= a1]
        if landed:
            out["long_kv_landed"] = landed
        steps = replica.steps_overlapping(a0, a1)
        out["steps"] = len(steps)
        if steps:
            worst = max(steps, key=lambda s: s["end"] - s["start"])
            out["max_step_ms"] = _ms(worst["end"] - worst["start"])
            out["max_step_prefill_tokens"] = worst["prefill_tokens"]
            out["max_step_batch"] = worst["batch_size"]
    return out


def worst_requests(reqs: Sequence[dict], *, n: int = 3, top_gaps: int = 3, longs: Sequence[dict] = (),
                   replica: Replica | None = None, handoff: bool = False) -> list[dict]:
    """The `n` requests with the highest TPOT, each with its `top_gaps` largest gaps located (`locate_gap`)."""
    scored = [(t, r) for r in reqs if (t := tpot_s(r)) is not None]
    scored.sort(key=lambda x: -x[0])
    out = []
    for t, r in scored[:n]:
        gaps = sorted(chunk_gaps(r), key=lambda g: -g["gap_s"])[:top_gaps]
        out.append({"id": r.get("id"), "tpot_ms": _ms(t), "ttft_ms": _ms(r["t"][0] - r["start"]),
                    "start_s": _r(r["start"]), "end_s": _r(r["end"]),
                    "gaps": [locate_gap(g, longs=longs, replica=replica, handoff=handoff) for g in gaps]})
    return out


# -- server side --------------------------------------------------------------------------------------------------
class Replica:
    """One replica's timeline on the run's clock (seconds from `t0`), indexed for the questions asked here."""

    def __init__(self, timeline: dict, t0: float) -> None:
        fields = timeline.get("step_fields") or ()
        self.role = timeline.get("role")
        self.steps: list[dict] = []
        for row in timeline.get("steps", ()):
            s = dict(zip(fields, row))
            s["start"] -= t0
            s["end"] -= t0
            self.steps.append(s)
        self.steps.sort(key=lambda s: s["start"])
        self._by_token: dict[tuple[str, int], dict] = {}
        for s in self.steps:
            for rid, count in s.get("tokens") or ():
                self._by_token.setdefault((rid, count), s)
        self._marks: dict[tuple[str, str], tuple[float, dict]] = {}
        for t, kind, rid, phases in timeline.get("marks", ()):
            self._marks.setdefault((kind, rid), (t - t0, {k: v - t0 for k, v in (phases or {}).items()}))
        # the process's garbage collections (deploy/gc_pauses.py): (start, seconds, generation); None: not recorded
        self.gc = None if "gc" not in timeline else sorted((t - t0, secs, gen) for t, secs, gen, _ in timeline["gc"])
        # the metrics reporter's ticks (deploy/metrics.py EngineReporter): (start, seconds, CPU seconds); None: not
        # recorded
        self.ticks = None if "metrics_ticks" not in timeline else sorted(
            (t - t0, secs, cpu[0] if cpu else math.nan) for t, secs, *cpu in timeline["metrics_ticks"])
        self._serve: dict[tuple[str, str], float] = {}
        self._chunks: dict[str, list[tuple[float, int]]] = {}  # request id -> (time, tokens) of chunks with tokens
        for t, rid, kind, ntok in timeline.get("serve_marks", ()):
            self._serve.setdefault((kind, rid), t - t0)
            if kind == "chunk" and ntok > 0:
                self._chunks.setdefault(rid, []).append((t - t0, ntok))

    def step_with_token(self, rid: str, count: int) -> dict | None:
        """The step after which request `rid` had `count` output tokens on this replica."""
        return self._by_token.get((rid, count))

    def mark(self, kind: str, rid: str) -> float | None:
        m = self._marks.get((kind, rid))
        return None if m is None else m[0]

    def phase(self, kind: str, rid: str, name: str) -> float | None:
        """A transfer phase mark carried by a handoff mark (e.g. the receiver's `landed`)."""
        m = self._marks.get((kind, rid))
        return None if m is None else m[1].get(name)

    def landed(self, rid: str) -> float | None:
        """When the request's KV was written on this (decode) replica: the receiver's own mark, else when the
        engine saw it."""
        return self.phase("landed", rid, "landed") or self.mark("landed", rid)

    def serve_mark(self, kind: str, rid: str) -> float | None:
        return self._serve.get((kind, rid))

    def tokens_before(self, req: dict) -> int:
        """Output tokens the client got from elsewhere before this replica's chunks of request `req` (1 on a
        decode replica whose stream opened after the prefill's first token went out through the router; 0 when
        its stream carried the first token too, and on a unified replica)."""
        missing = sum(token_counts(req)) - sum(n for _t, n in self._chunks.get(req["id"], ()))
        return min(max(missing, 0), 1)  # more missing: this replica's marks are incomplete, not another source

    def chunk_left_at(self, rid: str, cum_tokens: int, first: int = 0) -> float | None:
        """When the chunk that brought request `rid` to `cum_tokens` output tokens left this replica (`first`:
        tokens the client had before this replica's chunks, 1 on a decode replica)."""
        total = first
        for t, n in self._chunks.get(rid, ()):
            total += n
            if total == cum_tokens:
                return t
            if total > cum_tokens:
                return None
        return None

    def steps_overlapping(self, a0: float, a1: float) -> list[dict]:
        return [s for s in self.steps if s["start"] <= a1 and s["end"] >= a0]


def step_summary(steps: Sequence[dict]) -> dict[str, Any]:
    """Step times and where the replica's busy wall time went.

    Busy wall = from the first step's start to the last one's end, less the time the loop slept for want of work
    (idle_s). It splits into forward (model forward incl. device sync), in-step host (scheduling, batch building,
    sampling glue, transfer sends/polls inside `Engine.step`), publish (outputs to the streams), inbox (adds,
    aborts, calls) and `other_gap` (the rest between steps: the step thread waiting for the GIL while the replica's
    event loop, Ray and transfer threads run, or steps that only polled transfers)."""
    if not steps:
        return {"n": 0}
    dur = [s["end"] - s["start"] for s in steps]
    out: dict[str, Any] = {
        "n": len(steps),
        "step_ms": dist_ms(dur),
        "decode_only_step_ms": dist_ms(d for d, s in zip(dur, steps) if s["prefill_tokens"] == 0),
        "with_prefill_step_ms": dist_ms(d for d, s in zip(dur, steps) if s["prefill_tokens"] > 0),
        "forward_ms": dist_ms(s["forward_s"] for s in steps),
        "host_ms": dist_ms(s["host_s"] for s in steps),
        "batch_p50": pctl([s["batch_size"] for s in steps], 50),
    }
    span = steps[-1]["end"] - steps[0]["start"]
    rest = steps[1:]
    idle = sum(s["idle_s"] for s in rest)
    busy = span - idle
    parts = {"forward": sum(s["forward_s"] for s in steps), "in_step_host": sum(s["host_s"] for s in steps),
             "publish": sum(s["publish_s"] for s in rest), "inbox": sum(s["inbox_s"] for s in rest)}
    gaps = span - sum(dur)
    parts["other_gap"] = gaps - idle - parts["publish"] - parts["inbox"]
    out["wall"] = {"span_s": round(span, 4), "idle_s": round(idle, 4), "busy_s": round(busy, 4)}
    if busy > 0:
        out["busy_fraction"] = {k: round(v / busy, 4) for k, v in parts.items()}
        out["not_forward_fraction"] = round(1.0 - parts["forward"] / busy, 4)
    return out


def gc_summary(replica: Replica, slow_ms: float = 10.0) -> dict[str, Any] | None:
    """The replica's collections during its steps, and how many of its steps over `slow_ms` overlap one."""
    if replica.gc is None or not replica.steps:
        return None
    a, b = replica.steps[0]["start"], replica.steps[-1]["end"]
    pauses = [(t, secs, gen) for t, secs, gen in replica.gc if a <= t <= b]
    slow = [st for st in replica.steps if (st["end"] - st["start"]) * 1e3 > slow_ms]
    with_gc = [st for st in slow if any(_overlaps(st["start"], st["end"], t, t + secs) for t, secs, _ in pauses)]
    ticks = [x for x in replica.ticks or () if a <= x[0] <= b]
    with_tick = [st for st in slow if any(_overlaps(st["start"], st["end"], t, t + secs) for t, secs, _ in ticks)]
    return {"n": len(pauses), "gen2": sum(1 for p in pauses if p[2] == 2),
            "max_ms": max((p[1] * 1e3 for p in pauses), default=0.0),
            "total_ms": sum(p[1] for p in pauses) * 1e3, "slow_steps": len(slow), "slow_with_gc": len(with_gc),
            "ticks": len(ticks), "tick_max_ms": max((x[1] * 1e3 for x in ticks), default=0.0),
            "tick_cpu_max_ms": max((x[2] * 1e3 for x in ticks), default=0.0),
            "slow_with_tick": None if replica.ticks is None else len(with_tick)}


def handoff_split(req: dict, *, prefill: Replica | None = None, decode: Replica | None = None,
                  unified: Replica | None = None) -> dict | None:
    """Split one request's first -> second token gap (client clock) into where it went.

    Disaggregated (`prefill` and `decode`), along the chain prefill step end -> send -> KV landed -> decode step
    that made token 2 -> client; the first token's own trip (prefill step end -> client) is subtracted:
        gap = step_end_to_send + transfer + landed_to_decode_step + decode_step_to_client - first_token_hop
    (step_end_to_send is negative while the send is called inside the step that finished the prompt).
    `landed_to_decode_step` = landed_to_activated (the first token comes in the KV header, so this is the decode
    engine noticing the landed pages; through `continue_remote` after a retried prefill) + activated_to_step_end.
    Unified: gap = engine (step of token 1 end -> step of token 2 end) + decode_step_to_client - first_token_hop.
    `events_ms`: each mark relative to the end of the step that made the first token. None when a piece is
    missing (the request failed, or its first chunk carried more than the first token). The second chunk may carry
    several tokens (a decode replica runs ahead of a stream that attaches late): the split follows token 2."""
    rid = req.get("id")
    if not rid or not req.get("ok") or len(req["t"]) < 2 or token_counts(req)[0] != 1:
        return None
    c1, c2 = req["t"][0], req["t"][1]
    if unified is not None:
        s1, s2 = unified.step_with_token(rid, 1), unified.step_with_token(rid, 2)
        if s1 is None or s2 is None:
            return None
        seg = {"engine": s2["end"] - s1["end"], "decode_step_to_client": c2 - s2["end"],
               "first_token_hop": c1 - s1["end"]}
        return {"id": rid, "gap_ms": _ms(c2 - c1), "segments_ms": {k: _ms(v) for k, v in seg.items()}}
    if prefill is None or decode is None:
        return None
    p, d = prefill.step_with_token(rid, 1), decode.step_with_token(rid, 2)
    send, landed, activated = prefill.mark("send", rid), decode.landed(rid), decode.mark("activated", rid)
    if p is None or d is None or send is None or landed is None:
        return None
    seg = {"step_end_to_send": send - p["end"], "transfer": landed - send, "landed_to_decode_step": d["end"] - landed,
           "decode_step_to_client": c2 - d["end"], "first_token_hop": c1 - p["end"]}
    if activated is not None:
        seg["landed_to_activated"] = activated - landed
        seg["activated_to_step_end"] = d["end"] - activated
    events = {"prefill_step_start": p["start"], "send": send,
              "send_posted": prefill.phase("settled", rid, "posted"), "kv_landed": landed,
              "landed_seen": decode.mark("landed", rid), "acked": prefill.phase("settled", rid, "acked"),
              "settled_seen": prefill.mark("settled", rid), "outcome_left": prefill.serve_mark("outcome", rid),
              "decode_called": decode.serve_mark("decode", rid), "first_known": decode.mark("first_known", rid),
              "activated": activated, "decode_step_start": d["start"], "decode_step_end": d["end"],
              "token2_left": decode.chunk_left_at(rid, 1 + token_counts(req)[1], first=decode.tokens_before(req)),
              "client_token1": c1, "client_token2": c2}
    return {"id": rid, "gap_ms": _ms(c2 - c1), "segments_ms": {k: _ms(v) for k, v in seg.items()},
            "events_ms": {k: _ms(None if v is None else v - p["end"]) for k, v in events.items()}}


def split_summary(splits: Sequence[dict]) -> dict[str, dict]:
    """p50/p90/max of each segment over the requests."""
    return _summary(splits, "segments_ms")


def events_p50(splits: Sequence[dict]) -> dict[str, float]:
    """The median of each handoff event (ms after the prefill step end), in the order they happen."""
    med = {k: d["p50"] for k, d in _summary(splits, "events_ms").items() if d.get("n")}
    return dict(sorted(med.items(), key=lambda kv: kv[1]))


def _summary(splits: Sequence[dict], key: str) -> dict[str, dict]:
    names = dict.fromkeys(k for s in splits for k in s.get(key, {}))
    return {k: dist_ms([s[key][k] / 1e3 for s in splits if s[key].get(k) is not None]) for k in names}


def serve_hops(reqs: Sequence[dict], producer: Replica) -> dict[str, dict]:
    """Per chunk, after the engine step that made its last token: engine -> server (AsyncEngine publish, asyncio
    queue, EngineServer delta) and server -> client (Serve router + ingress + HTTP/SSE). Chunks the client got
    from elsewhere first (a relayed first token: `Replica.tokens_before`) are left out."""
    to_server, to_client, total = [], [], []
    for r in reqs:
        rid = r.get("id")
        if not rid or not r.get("ok"):
            continue
        first = producer.tokens_before(r)  # one token = the first chunk
        for t, cum in list(zip(r["t"], cumulative_tokens(r)))[first:]:
            step = producer.step_with_token(rid, cum)
            if step is None:
                continue
            total.append(t - step["end"])
            left = producer.chunk_left_at(rid, cum, first=first)
            if left is not None:
                to_server.append(left - step["end"])
                to_client.append(t - left)
    return {"step_to_client_ms": dist_ms(total), "engine_to_server_ms": dist_ms(to_server),
            "server_to_client_ms": dist_ms(to_client)}


# -- one phase ----------------------------------------------------------------------------------------------------
def diagnose_phase(trace: dict, server: dict[str, dict] | None, *, worst: int = 3) -> dict[str, Any]:
    """Everything above for one phase: `trace` = {"t0", "short", "long"} (client), `server` = replica name ->
    timeline ("prefill-0"/"decode-0", "unified-0" or "inproc")."""
    t0 = trace["t0"]
    reps = {name: Replica(tl, t0) for name, tl in (server or {}).items()}
    prefill = next((r for n, r in reps.items() if n.startswith("prefill")), None)
    decode = next((r for n, r in reps.items() if n.startswith("decode")), None)
    unified = next((r for n, r in reps.items() if not n.startswith(("prefill", "decode"))), None)
    producer = decode or unified  # the replica whose steps make the short requests' later tokens
    short, long = trace["short"], trace.get("long", [])
    out: dict[str, Any] = {"gaps": gap_distributions(short)}
    out["worst"] = worst_requests(short, n=worst, longs=long, replica=producer, handoff=decode is not None)
    if long:
        out["long"] = long_timeline(long, decode)
    if producer is not None:
        out["steps"] = step_summary(producer.steps)
        out["serve_hops"] = serve_hops(short, producer)
        out["gc"] = gc_summary(producer)
    if prefill is not None:
        out["prefill_steps"] = step_summary(prefill.steps)
    if producer is not None:
        splits = [s for r in short if (s := handoff_split(r, prefill=prefill, decode=decode,
                                                          unified=None if decode else unified)) is not None]
        out["first_gap_split"] = {"n": len(splits), "summary": split_summary(splits),
                                  "events_p50_ms": events_p50(splits), "requests": splits}
    return out


# -- printing -----------------------------------------------------------------------------------------------------
def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _pp(d: dict | None, *keys: str) -> str:
    d = d or {}
    return "/".join(_f(d.get(k)) for k in keys)


def format_phase(label: str, short_summary: dict, diag: dict) -> list[str]:
    """A few lines for one mode and phase (ms): gaps, steps, the first -> second token split, the worst requests,
    the long prompts."""
    pad = " " * (len(label) + 1)
    g = diag.get("gaps", {})
    lines = [f"{label} TPOT p50/p99 {_f(short_summary.get('median_tpot_ms'))}/{_f(short_summary.get('p99_tpot_ms'))}"
             f" | 1st->2nd gap p50/p99/max {_pp(g.get('first_gap_ms'), 'p50', 'p99', 'max')}"
             f" | later ITL p50/p99/max {_pp(g.get('later_itl_ms'), 'p50', 'p99', 'max')}"]
    st = diag.get("steps")
    if st and st.get("n"):
        bf = st.get("busy_fraction", {})
        between = _sum(bf.get("other_gap"), bf.get("inbox"))
        lines.append(
            f"{pad}steps p50/p99/max {_pp(st['step_ms'], 'p50', 'p99', 'max')} (decode-only "
            f"{_pp(st['decode_only_step_ms'], 'p50', 'p99')}, with prefill "
            f"{_pp(st['with_prefill_step_ms'], 'p50', 'max')} in {st['with_prefill_step_ms'].get('n', 0)}, n "
            f"{st['n']}) | busy wall: forward "
            f"{_pct(bf.get('forward'))}, in-step host {_pct(bf.get('in_step_host'))}, publish "
            f"{_pct(bf.get('publish'))}, between steps {_pct(between)} = not forward "
            f"{_pct(st.get('not_forward_fraction'))}")
    gcs = diag.get("gc")
    if gcs:
        lines.append(f"{pad}gc: {gcs['n']} collections ({gcs['gen2']} full), max {_f(gcs['max_ms'])} ms, total "
                     f"{_f(gcs['total_ms'])} ms | steps over 10 ms {gcs['slow_steps']}, {gcs['slow_with_gc']} of "
                     f"them beside a collection, {gcs.get('slow_with_tick', '-')} beside a metrics tick (ticks "
                     f"{gcs.get('ticks', 0)}, max {_f(gcs.get('tick_max_ms'))} ms, CPU max "
                     f"{_f(gcs.get('tick_cpu_max_ms'))} ms)")
    pre = diag.get("prefill_steps")
    if pre and pre.get("n"):  # a short prompt's step on the prefill replica is as long as what shares it
        lines.append(f"{pad}prefill replica steps p50/p99/max {_pp(pre['step_ms'], 'p50', 'p99', 'max')}, n "
                     f"{pre['n']}, not forward {_pct(pre.get('not_forward_fraction'))}")
    parts = []
    hops = diag.get("serve_hops")
    if hops and hops["step_to_client_ms"].get("n"):
        part = f"step->client p50/p99 {_pp(hops['step_to_client_ms'], 'p50', 'p99')}"
        if hops["engine_to_server_ms"].get("n"):
            part += (f" (engine->server {_pp(hops['engine_to_server_ms'], 'p50')}, server->client "
                     f"{_pp(hops['server_to_client_ms'], 'p50')})")
        parts.append(part)
    fg = diag.get("first_gap_split") or {}
    split = fg.get("summary") or {}
    if split:
        order = ["step_end_to_send", "transfer", "landed_to_decode_step", "landed_to_activated", "engine",
                 "decode_step_to_client", "first_token_hop"]
        parts.append("1st->2nd split p50/p90: " + ", ".join(
            f"{k} {_pp(split[k], 'p50', 'p90')}" for k in order if k in split and split[k].get("n")))
    if parts:
        lines.append(pad + " | ".join(parts))
    if fg.get("events_p50_ms") and "transfer" in split:
        lines.append(f"{pad}handoff p50, ms after the prefill step end: " + ", ".join(
            f"{k} {_f(v)}" for k, v in fg["events_p50_ms"].items()))
    worst = diag.get("worst") or []
    if worst:
        lines.append(f"{pad}worst TPOT (gap #token ms@s): " + "; ".join(_worst(w) for w in worst))
    if diag.get("long"):
        lines.append(f"{pad}long (s): " + "; ".join(
            f"L{x['i']} sent {_f(x['sent_s'], 2)} 1st {_f(x['first_token_s'], 2)}"
            + (f" kv {_f(x['kv_landed_s'], 2)}" if x.get("kv_landed_s") is not None else "")
            + f" done {_f(x['finish_s'], 2)}" for x in diag["long"]))
    return lines


def _sum(*vals: float | None) -> float | None:
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _worst(w: dict, top: int = 2) -> str:
    gaps = []
    for g in w["gaps"][:top]:
        tags = []
        if g.get("handoff"):
            tags.append("handoff")
        if g.get("long_prefilling"):
            tags.append("L" + ",L".join(map(str, g["long_prefilling"])) + " prefill")
        if g.get("long_kv_landed"):
            tags.append("L" + ",L".join(map(str, g["long_kv_landed"])) + " kv")
        if "steps" in g:  # the producing replica's steps in the gap: count, longest (ms / its prefill tokens)
            longest = f", max {_f(g.get('max_step_ms'))} ms/{g.get('max_step_prefill_tokens')} pf" if g["steps"] else ""
            tags.append(f"{g['steps']} steps{longest}")
        gaps.append(f"#{g['index']} {_f(g['gap_ms'])}@{_f(g['at_s'], 2)}s" + (f" [{', '.join(tags)}]" if tags else ""))
    return f"{_f(w['tpot_ms'])} ({' '.join(gaps)})"
