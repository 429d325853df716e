"""The CPU path of benchmarks/bench_parallel.py (gloo, tiny preset): every sharded configuration equals one
shard, the JSON it writes carries the step times, and an unequal run is reported as a failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_parallel.py"


def _bench(out: Path, *extra: str, configs: str = "single,tp2,ep2,dp2-ep2") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--configs", configs, "--batches", "1,2", "--reps", "2", "--warmup", "1",
                           "--eq-steps", "3", "--timeout", "120", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def test_cpu_path_equal_to_one_shard_with_step_times(tmp_path):
    proc = _bench(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert report["failures"] == []
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"single", "tp2", "ep2", "dp2-ep2"}
    for name in ("tp2", "ep2", "dp2-ep2"):
        eq = rows[name]["equality"]
        assert rows[name]["equal"] and eq["argmax_agreement"] == 1.0
        # really computed on a different path (summation order differs), and within fp32 tolerance
        assert 0 < eq["max_rel_diff"] <= 1e-4, (name, eq)
    for r in rows.values():
        assert set(r["decode_ms"]) == {"1", "2"} and all(ms > 0 for ms in r["decode_ms"].values())
    # the table is the last thing printed
    assert proc.stdout.strip().splitlines()[-1].startswith("dp2-ep2")


def test_an_unequal_model_is_reported(tmp_path):
    """Different weights for the sharded run (another seed) must fail the equality check, not pass silently."""
    proc = _bench(tmp_path, "--seed-sharded", "1", configs="single,ep2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert any("not equal to one device" in f for f in report["failures"])
