"""What benchmarks/bench_serving_pd.py reports: a phase's and a mode's numbers (`phase_summary`, `mode_summary`),
the Serve path against the in-process engine (`serve_vs_inproc`), and the two printouts (`format_diagnosis`: where
the time went, from benchmarks/serving_trace.py; `format_table`: one row per mode).
"""
from __future__ import annotations

import math
from typing import Any

import serving_trace  # beside this module; bench_serving_pd.py puts the folder on sys.path

PERCENTILES = [50.0, 90.0, 99.0]
TPOT_GOAL_RATIO = 1.2  # PERF.md: decode p99 TPOT with concurrent long prefills <= 1.2x the decode-only TPOT


def phase_summary(short: list, long: list, duration: float) -> dict[str, Any]:
    from deploy.bench import summarize

    errors = sorted({r.error for r in [*short, *long] if not r.success})[:5]
    return {"duration_s": round(duration, 3),
            "short": summarize(short, duration, percentiles=PERCENTILES),
            "long": summarize(long, duration, percentiles=PERCENTILES) if long else {"completed": 0, "failed": 0},
            "errors": errors}


def mode_summary(doc: dict) -> dict[str, Any]:
    """The numbers the table shows for one mode."""
    base, mixed = doc["decode_only"]["short"], doc["mixed"]["short"]
    long = doc["mixed"]["long"]
    base_p50 = base["median_tpot_ms"]
    out = {
        "decode_only_tpot_p50_ms": base_p50, "decode_only_tpot_p99_ms": base["p99_tpot_ms"],
        "decode_only_itl_p99_ms": base["p99_itl_ms"],
        "mixed_tpot_p50_ms": mixed["median_tpot_ms"], "mixed_tpot_p99_ms": mixed["p99_tpot_ms"],
        "mixed_itl_p99_ms": mixed["p99_itl_ms"],
        "ratio_p99_to_decode_only_p50": mixed["p99_tpot_ms"] / base_p50 if base_p50 > 0 else math.nan,
        "ratio_p99_to_decode_only_p99": (mixed["p99_tpot_ms"] / base["p99_tpot_ms"]
                                         if base["p99_tpot_ms"] > 0 else math.nan),
        "mixed_ttft_p50_ms": mixed["median_ttft_ms"], "mixed_ttft_p99_ms": mixed["p99_ttft_ms"],
        "decode_only_ttft_p50_ms": base["median_ttft_ms"], "decode_only_ttft_p99_ms": base["p99_ttft_ms"],
        "long_ttft_p50_ms": long.get("median_ttft_ms"), "long_completed": long["completed"],
        "failed": base["failed"] + mixed["failed"] + long["failed"],
    }
    kv = doc["mixed"].get("kv_transfers")
    if kv:
        out.update(kv_transfers=kv["transfers"], kv_failed=kv["failed"], kv_mb=kv["bytes"] / 1e6,
                   kv_gb_per_s=kv["gb_per_s"])
    return out


def serve_vs_inproc(results: dict) -> dict[str, dict]:
    """Per served mode: its decode-only TPOT p50 against the in-process engine's (and the decode replica's step
    p50 against the in-process one's: equal steps + higher TPOT = the time is between steps or in Serve)."""
    modes = results.get("modes", {})
    ref = modes.get("inproc", {})
    if not ref.get("summary"):
        return {}
    base = ref["summary"]["decode_only_tpot_p50_ms"]
    out = {}
    for mode in ("unified", "pd"):
        s = modes.get(mode, {}).get("summary")
        if not s or base <= 0:
            continue
        out[mode] = {"tpot_p50_ms": s["decode_only_tpot_p50_ms"], "inproc_tpot_p50_ms": base,
                     "overhead": s["decode_only_tpot_p50_ms"] / base - 1.0,
                     "step_p50_ms": _step_p50(modes[mode]), "inproc_step_p50_ms": _step_p50(ref)}
    return out


def _step_p50(doc: dict) -> float | None:
    return (((doc.get("decode_only") or {}).get("diagnosis") or {}).get("steps") or {}).get("step_ms", {}).get("p50")


def format_diagnosis(results: dict) -> str:
    """A few lines per mode and phase on where the time went (serving_trace.format_phase)."""
    st = serving_trace
    lines = ["-" * 140, "where the time goes (ms unless noted; all of it: modes.<mode>.<phase>.diagnosis in the JSON, "
                        "raw traces in the .trace.json)"]
    for mode, doc in results.get("modes", {}).items():
        for phase in ("decode_only", "mixed"):
            ph = doc.get(phase)
            if not ph:
                continue
            diag = ph.get("diagnosis")
            if diag is None:
                why = ph.get("diagnosis_error") or ph.get("trace_error") or "no trace"
                lines.append(f"[{mode}] {phase}: no diagnosis ({why})")
                continue
            if ph.get("trace_error"):
                lines.append(f"[{mode}] {phase}: replica timelines missing ({ph['trace_error']}); client side only")
            lines += st.format_phase(f"[{mode}] {phase}", ph["short"], diag)
    return "\n".join(lines)


def format_table(results: dict) -> str:
    """Short summary: one row per mode (ms)."""
    cols = [("mode", 8), ("TPOT dec-only p50/p99", 22), ("TPOT mixed p50/p99", 19), ("p99/dec50", 9),
            ("ITL p99 dec/mix", 16), ("TTFT mixed p50/p99", 19), ("long TTFT", 10), ("KV n / MB / GB/s", 21),
            ("fail", 4)]
    lines = ["=" * 140, "  ".join(f"{c:<{w}}" for c, w in cols)]
    f1 = lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"  # noqa: E731
    for mode, doc in results.get("modes", {}).items():
        s = doc.get("summary")
        if not s:
            lines.append(f"{mode:<8}  {'error: ' + str(doc.get('error', 'incomplete'))[:120]}")
            continue
        kv = (f"{s['kv_transfers']} / {s['kv_mb']:.3g} / {s['kv_gb_per_s']:.3g}" if "kv_transfers" in s else "-")
        cells = [mode, f"{f1(s['decode_only_tpot_p50_ms'])} / {f1(s['decode_only_tpot_p99_ms'])}",
                 f"{f1(s['mixed_tpot_p50_ms'])} / {f1(s['mixed_tpot_p99_ms'])}",
                 f"{s['ratio_p99_to_decode_only_p50']:.2f}x",
                 f"{f1(s['decode_only_itl_p99_ms'])} / {f1(s['mixed_itl_p99_ms'])}",
                 f"{f1(s['mixed_ttft_p50_ms'])} / {f1(s['mixed_ttft_p99_ms'])}", f1(s["long_ttft_p50_ms"]), kv,
                 str(s["failed"])]
        lines.append("  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, cols)))
    for err in results.get("errors", [])[:6]:
        lines.append(f"error: {str(err)[:200]}")
    overhead = serve_vs_inproc(results)
    if overhead:
        lines.append("Serve path vs in-process engine, decode-only TPOT p50 (PERF.md goal <= +5%): " + ", ".join(
            f"{m} {o['tpot_p50_ms']:.1f} vs {o['inproc_tpot_p50_ms']:.1f} ({100 * o['overhead']:+.0f}%; decode step "
            f"p50 {f1(o.get('step_p50_ms'))} vs {f1(o.get('inproc_step_p50_ms'))})" for m, o in overhead.items()))
    lines.append(f"goal (PERF.md): pd mixed TPOT p99 <= {TPOT_GOAL_RATIO}x decode-only TPOT (p50); ms unless noted"
                 + (f"; HTTP front: {results['http_proxy']}" if results.get("http_proxy") else ""))
    lines.append("=" * 140)
    return "\n".join(lines)
