"""Launch a test file's rank processes (gloo on the CPU) and fail with each failed rank's log."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_ranks(script: str, spec: Path, world: int, timeout_s: float = 300.0) -> None:
    """`python script <rank> <spec>` for every rank at once, one intra-op thread each; asserts all exited 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(r), str(spec)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"rank {r} (exit {p.returncode}):\n{log[-3000:]}" for r, (p, log) in enumerate(zip(procs, logs))
              if p.returncode != 0]
    assert not failed, "\n".join(failed)
