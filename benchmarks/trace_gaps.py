"""Where the GPU sat idle in a torch.profiler chrome trace, and what the host was running meanwhile.

A step's time over its device time is host work with the GPU idle: building inputs before the first launch, a
synchronising copy or `.tolist()` that drains the queue, sampling and bookkeeping after the forward. The
profiler's key averages cannot show it (they sum busy time); this reads the exported trace instead:

  busy   the union of the device intervals (kernels, memcpy, memset) inside the host span of the trace;
  gaps   the holes in it, longest first;
  blame  for every host Python function (`with_stack=True`) or op, the idle time its span overlaps. Outer
         functions contain inner ones, so read the list as a tree: the deepest entry with most of a parent's
         idle time is where it goes.

  python3 benchmarks/trace_gaps.py trace.json[.gz]      # prints the summary
Used by bench_engine_prefill.py --profile (it writes the summary beside the kernel table).
"""
from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"python_function", "cpu_op", "cuda_runtime", "user_annotation"}


def load_trace(path: str | Path) -> list[dict]:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: float, b: float, spans: list[tuple[float, float]], starts: list[float]) -> float:
    """Time of [a, b) covered by the sorted disjoint `spans` (their starts in `starts`)."""
    import bisect

    i = max(bisect.bisect_right(starts, a) - 1, 0)
    total = 0.0
    while i < len(spans) and spans[i][0] < b:
        lo, hi = max(a, spans[i][0]), min(b, spans[i][1])
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def idle_summary(events: list[dict], *, min_gap_us: float = 20.0, top: int = 30) -> dict:
    """-> {span_us, busy_us, idle_us, gaps (longest first: start offset, length), blame (name -> idle us)}.

    The span is the host side's first to last event; times in microseconds as the trace stores them."""
    dev = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
           if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS and e.get("dur", 0) > 0]
    if not dev or not host:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": [], "blame": []}
    t0 = min(e["ts"] for e in host)
    t1 = max(e["ts"] + e["dur"] for e in host)
    busy = [(max(a, t0), min(b, t1)) for a, b in _union(dev) if b > t0 and a < t1]
    busy_us = sum(b - a for a, b in busy)
    idle = []
    cur = t0
    for a, b in busy:
        if a > cur:
            idle.append((cur, a))
        cur = max(cur, b)
    if cur < t1:
        idle.append((cur, t1))
    idle = [(a, b) for a, b in idle if b - a >= min_gap_us]
    starts = [a for a, _ in idle]
    blame: dict[str, float] = defaultdict(float)
    for e in host:
        o = _overlap(e["ts"], e["ts"] + e["dur"], idle, starts)
        if o > 0:
            blame[e["name"]] += o
    gaps = sorted(((a - t0, b - a) for a, b in idle), key=lambda g: -g[1])
    return {"span_us": t1 - t0, "busy_us": busy_us, "idle_us": sum(b - a for a, b in idle),
            "num_gaps": len(idle), "gaps": gaps[:top],
            "blame": sorted(blame.items(), key=lambda kv: -kv[1])[:top]}


def format_summary(s: dict) -> str:
    lines = [f"host span {s['span_us'] / 1e3:.2f} ms: GPU busy {s['busy_us'] / 1e3:.2f} ms, idle in gaps >= 20 us "
             f"{s['idle_us'] / 1e3:.2f} ms ({s.get('num_gaps', 0)} gaps)"]
    lines.append("longest gaps (ms after the start: length ms): " +
                 ", ".join(f"{a / 1e3:.2f}: {d / 1e3:.3f}" for a, d in s["gaps"][:12]))
    lines.append(f"{'idle ms':>9}  host function or op overlapping the idle time")
    lines += [f"{us / 1e3:9.3f}  {name[:150]}" for name, us in s["blame"]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_summary(idle_summary(load_trace(sys.argv[1]))))
