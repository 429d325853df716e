"""benchmarks/probe_compiles.py on the CPU: the serving mix runs through the engine to the end (every request of
the mix that fits finishes), the JSON and the table come out; the per-phase count of the JIT hooks' records."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "probe_compiles.py"


def test_tiny_cpu_run_drives_the_mix_and_writes_json(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "probe_compiles.json").read_text())
    assert doc["serving_steps"] > 16 and doc["records"] == []  # the CPU runs the torch references: no Triton
    assert proc.stdout.strip().splitlines()[-1].startswith("serving | 0 | 0")


def test_compile_log_counts_per_phase_and_tells_compiles_from_loads(monkeypatch):
    """The hooks pair each cache miss's start and end by key: a slow one counts as compiled, a quick one (a
    disk-cache load) only as a variant."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import probe_compiles

    clock = iter([0.0, 1.0, 10.0, 10.01, 20.0, 22.5])
    monkeypatch.setattr(probe_compiles.time, "perf_counter", lambda: next(clock))
    log = probe_compiles.CompileLog()

    class Fn:
        name = "_kernel"

    hook = dict(repr="_kernel[...]", fn=Fn, compile={}, is_manual_warmup=False, already_compiled=False)
    for phase, key in (("startup", "a"), ("serving", "b"), ("serving", "c")):
        log.phase = phase
        assert log._before(key=key, **hook) is None  # None: Triton goes on and compiles
        log._after(key=key, **hook)
    assert log.summary() == {"startup": {"variants": 1, "compiled": 1, "seconds": 1.0},
                             "serving": {"variants": 2, "compiled": 1, "seconds": 2.51}}
    assert [r["kernel"] for r in log.records] == ["_kernel"] * 3
