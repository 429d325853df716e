"""The project's pins resolve on the public package index (issue 22): torch 2.13.0 there is the CUDA build and
requires triton 3.7.1, so a triton pin of our own made `pip install m3serve[test]` unresolvable anywhere but on a
machine serving a local CPU torch. This asks pip's resolver, against pypi.org alone and with every local index and
constraint switched off, for the runtime and test requirements as pyproject.toml declares them (metadata only:
`--dry-run`, nothing installed; ~1 minute). The CPU stack (`.[test,cpu]` with a CPU-only torch) is what
`make install` resolves on every run of the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _requirements(extras: tuple[str, ...]) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]


def test_no_pin_fights_torch_over_triton():
    reqs = _requirements(("test",))
    assert "torch==2.13.0" in reqs
    assert not [r for r in reqs if r.replace(" ", "").startswith("triton")], reqs  # torch brings its own
    assert _requirements(("cpu",))[-1] == "triton==3.6.0"


@pytest.mark.timeout(420)
def test_runtime_and_test_pins_resolve_on_the_public_index(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("\n".join(_requirements(("test",))) + "\n")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no local index, find-links or constraints file: the public index alone
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--isolated", "--no-cache-dir",
         "--index-url", "https://pypi.org/simple", "--only-binary", ":all:", "--quiet", "--report", str(report),
         "-r", str(req)], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"] == "2.13.0" and chosen["ray"] == "2.60.0" and chosen["transformers"] == "5.23.0"
    assert "triton" in chosen, "the public torch build should bring its triton"
