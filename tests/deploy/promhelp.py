"""Test helpers for the metrics suites: a real Prometheus server on loopback, and the dashboard's queries.

Debian's `prometheus` package provides both `prometheus` and `promtool` (the Makefile's test target installs it).
"""
from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from deploy.http_front import free_port

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "m3serve.rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "m3serve.rules.test.yml"
DASHBOARD = REPO / "deploy" / "dashboards" / "m3serve.json"


def dashboard_queries(rate_interval: str = "1m") -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every dashboard target, Grafana variables replaced by what they expand
    to with "All" selected (`$__rate_interval` -> `rate_interval`)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = (t["expr"].replace("$__rate_interval", rate_interval)
                    .replace("$model_name", ".*").replace("$role", ".*"))
            out.append((panel["title"], t["refId"], expr))
    return out


class Prometheus:
    """A Prometheus process scraping `targets` (host:port) every `scrape_interval`, with our recording rules."""

    def __init__(self, workdir: Path, targets: list[str], *, scrape_interval: str = "1s",
                 rule_files: tuple[Path, ...] = (RULES,), metrics_path: str = "/metrics") -> None:
        self.workdir = Path(workdir)
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.rule_files = rule_files
        self.metrics_path = metrics_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> "Prometheus":
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (apt-get install -y prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        rules = "".join(f"  - {p}\n" for p in self.rule_files)
        targets = ", ".join(f'"{t}"' for t in self.targets)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(
            "global:\n"
            f"  scrape_interval: {self.scrape_interval}\n"
            f"  evaluation_interval: {self.scrape_interval}\n"
            f"rule_files:\n{rules}"
            "scrape_configs:\n"
            "  - job_name: m3serve\n"
            f"    metrics_path: {self.metrics_path}\n"
            f"    static_configs:\n      - targets: [{targets}]\n")
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        if doc.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {doc}")
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; a list of {"metric": {...}, "value": [t, "v"]}."""
        return self.api("query", query=expr)["result"]

    def values(self, expr: str) -> dict[tuple, float]:
        """Instant query as {sorted label items: value}."""
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in self.query(expr)}

    def scalar(self, expr: str) -> float | None:
        """The single value of `expr` (None when empty); fails on several series."""
        res = self.query(expr)
        assert len(res) <= 1, f"{expr}: {len(res)} series"
        return float(res[0]["value"][1]) if res else None

    def wait_until(self, expr: str, predicate, timeout_s: float = 30.0, poll_s: float = 0.5):
        """Poll `expr` until predicate(scalar or None) holds; returns the last value, raising on timeout."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.scalar(expr)
            if predicate(value):
                return value
            time.sleep(poll_s)
        raise TimeoutError(f"{expr}: last value {value}")

    def target_health(self) -> list[str]:
        return [t["health"] for t in self.api("targets")["activeTargets"]]

    def target_report(self) -> list[dict]:
        """Each target's health, last scrape error and duration (seconds): what an assertion on health shows."""
        return [{k: t.get(k) for k in ("scrapeUrl", "health", "lastError", "lastScrapeDuration")}
                for t in self.api("targets")["activeTargets"]]

    def wait_healthy(self, timeout_s: float = 30.0) -> list[str]:
        """Wait until every target's last scrape succeeded. On a loaded 2-core machine one scrape of Ray's
        metrics endpoint can overrun its timeout; the next one decides."""
        deadline = time.monotonic() + timeout_s
        health = self.target_health()
        while time.monotonic() < deadline and health != ["up"] * len(self.targets):
            time.sleep(0.5)
            health = self.target_health()
        return health


def has_finite_value(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


# Series names the dashboard and rules read (the API port's /metrics: vllm:* and m3serve_*), not the rules' own
# m3serve:* outputs.
METRIC_NAME_RE = re.compile(r"\b(?:vllm:[a-zA-Z0-9_]+|m3serve_[a-zA-Z0-9_]+)")
