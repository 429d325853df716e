"""benchmarks/trace_gaps.py: GPU idle gaps in a chrome trace and the host functions blamed for them, on a
hand-made trace whose answer is known."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trace_gaps.py"


def _module():
    spec = importlib.util.spec_from_file_location("trace_gaps_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


TRACE = [
    _x("python_function", "step", 0, 1000),  # the host span: 0 .. 1000 us
    _x("python_function", "build_inputs", 0, 300),  # GPU idle 0 .. 300 under it
    _x("kernel", "gemm", 300, 400),  # busy 300 .. 700
    _x("gpu_memcpy", "copy", 650, 100),  # overlaps the gemm: busy until 750
    _x("python_function", "sample", 760, 200),  # idle 750 .. 1000 (250 us), 200 of it under sample
    _x("kernel", "tiny", 990, 5),  # splits the tail gap: 750 .. 990 and 995 .. 1000 (5 us, under the 20 us cut)
    {"ph": "i", "cat": "instant", "name": "ignored", "ts": 10},
]


def test_idle_summary_on_a_known_trace(tmp_path):
    tg = _module()
    s = tg.idle_summary(TRACE)
    assert s["span_us"] == 1000 and s["busy_us"] == 455
    assert s["num_gaps"] == 2 and s["idle_us"] == 300 + 240
    assert [(round(a), round(d)) for a, d in s["gaps"]] == [(0, 300), (750, 240)]
    blame = dict(s["blame"])
    assert blame["step"] == 540 and blame["build_inputs"] == 300 and blame["sample"] == 200
    assert "gemm" not in blame  # device events are never blamed
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    assert tg.idle_summary(tg.load_trace(path)) == s
    text = tg.format_summary(s)
    assert "idle in gaps >= 20 us 0.54 ms (2 gaps)" in text and "build_inputs" in text


def test_no_device_events_means_no_gaps():
    tg = _module()
    s = tg.idle_summary([_x("python_function", "step", 0, 100)])
    assert s["gaps"] == [] and s["idle_us"] == 0.0
