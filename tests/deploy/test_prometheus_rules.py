"""Recording rules and the Grafana dashboard: promtool checks and unit tests, every name declared in
deploy/metrics.py, and every dashboard query answered with data by a real Prometheus scraping our metrics."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.metrics import METRICS, EngineMetrics, spec
from deploy.metrics import INGRESS_METRICS
from deploy.metrics_endpoint import IngressMetrics, exposition, merge_families, own_name, replica_sinks
from tests.deploy.promhelp import (
    DASHBOARD, METRIC_NAME_RE, RULE_TESTS, RULES, Prometheus, dashboard_queries, has_finite_value,
)
from workers.stats import EngineStats, RequestStats, StepStats, TransferStats

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None or shutil.which("prometheus") is None,
                                    reason="Debian's prometheus package is not installed (make test installs it)")


def _exported_families() -> set[str]:
    """Every family name the API port's /metrics can carry (any role's naming; the ingress's own)."""
    fams = set()
    for m in METRICS + INGRESS_METRICS:
        for role in ("unified", "prefill", "decode"):
            name = own_name(m, role) if m in METRICS else "m3serve_" + m.name
            if m.kind == "histogram":
                fams |= {name + s for s in ("_bucket", "_count", "_sum")}
            else:
                fams.add(name + ("_total" if m.kind == "counter" else ""))
    return fams


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_recording_rules_check_clean():
    res = _promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@needs_promtool
def test_recording_rules_unit_tests_pass():
    res = _promtool("test", "rules", str(RULE_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_a_wrong_rule_expectation_fails(tmp_path):
    """The rule tests can fail: the same tests with one expected value changed must not pass."""
    text = RULE_TESTS.read_text().replace("value: 13", "value: 14", 1)
    assert "value: 14" in text
    (tmp_path / "m3serve.rules.yml").write_text(RULES.read_text())
    (tmp_path / "t.yml").write_text(text)
    res = _promtool("test", "rules", str(tmp_path / "t.yml"))
    assert res.returncode != 0 and "m3serve:total_tokens:rate1m" in res.stdout + res.stderr


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    """promtool parses each query as the expression of a recording rule."""
    queries = dashboard_queries()
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, (_, _, expr) in enumerate(queries):
        lines += [f"      - record: dashboard:q{i}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text("\n".join(lines) + "\n")
    res = _promtool("check", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(queries)} rules found" in res.stdout


def test_dashboard_and_rules_use_only_declared_metrics():
    fams = _exported_families()
    exprs = " ".join(e for _, _, e in dashboard_queries())
    used = set(METRIC_NAME_RE.findall(exprs)) | set(METRIC_NAME_RE.findall(RULES.read_text()))
    assert used, "no m3serve metric referenced"
    assert used <= fams, sorted(used - fams)


def test_dashboard_covers_the_required_panels():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for fam in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                "inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le, role) (rate(vllm:{fam}_bucket" in exprs, (fam, q)
    for name, suffix in (("generation_tokens", "_total"), ("prompt_tokens", "_total"), ("num_requests_running", ""),
                         ("num_requests_waiting", ""), ("kv_cache_usage_perc", ""), ("kv_transferred_bytes", "_total"),
                         ("kv_transfer_seconds", "_bucket"), ("request_failure", "_total")):
        assert own_name(spec(name), "unified") + suffix in exprs, name
    assert "m3serve_ingress_time_to_first_token_seconds_bucket" in exprs
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])


# -- a real Prometheus scraping our exposition ------------------------------------------------------------------
class _Feeder:
    """Records a stream of synthetic-but-plausible engine stats for the three roles, each into its replica's own
    registry, and client timings into an ingress's; serves them merged as the API port's /metrics does, on
    loopback in the text format, until stopped (rates need a counter that keeps moving)."""

    def __init__(self) -> None:
        exports = []
        self.metrics = {}
        for role in ("unified", "prefill", "decode"):
            sink, export = replica_sinks(role, ray=False)
            self.metrics[role] = EngineMetrics("tiny", role, 0, sink=sink)
            exports.append(export)
        self.ingress = IngressMetrics("tiny", "0", ray=False)
        self._stop = threading.Event()
        self._n = 0
        ingress = self.ingress

        def body() -> bytes:
            families = [e.families() for e in exports] + [list(ingress.export.registry.collect())]
            return exposition(merge_families(families), None)[0]

        body_ = body

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = body_()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                         threading.Thread(target=self._feed, daemon=True)]

    def _feed(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(0.1)

    def tick(self) -> None:
        n = self._n = self._n + 1
        t0 = time.monotonic()
        tok = [t0 + 0.05 + 0.01 * k for k in range(5)]
        for role, m in self.metrics.items():
            m.record_request(RequestStats(request_id=f"{role}{n}", role=role, prompt_tokens=12,
                                          generation_tokens=1 if role == "prefill" else 5, finished_reason="length",
                                          arrival_time=t0, first_scheduled_time=t0 + 0.01, first_token_time=tok[0],
                                          finished_time=tok[0] if role == "prefill" else tok[-1],
                                          token_times=tok[:1] if role == "prefill" else tok))
            m.record_step(StepStats(step_time=0.004, host_overhead=0.001, batch_size=2, num_decode_tokens=2))
            m.record_engine(EngineStats(role=role, num_running=2, num_waiting=n % 3, num_pages_total=64,
                                        num_pages_free=48, prefix_cache_queries=12 * n, prefix_cache_hits=4 * n,
                                        num_preemptions=n // 10))
        self.ingress.record(0.07, 0.1, "finished")
        self.metrics["decode"].record_transfer(TransferStats(request_id=f"x{n}", num_bytes=1 << 20,
                                                             seconds=0.002, num_pages=4))
        if n % 5 == 0:
            self.metrics["decode"].record_request(RequestStats(request_id=f"f{n}", role="decode", prompt_tokens=3,
                                                               failure_reason="transfer"))
            self.ingress.record(0.07, 0.1, "finished")
        self.metrics["decode"].record_transfer(TransferStats(request_id=f"f{n}", num_bytes=0, seconds=1.0,
                                                                 num_pages=1, ok=False))

    def __enter__(self) -> "_Feeder":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()


@needs_promtool
def test_dashboard_queries_return_data_from_a_real_prometheus(tmp_path):
    with _Feeder() as feeder, Prometheus(tmp_path / "prom", [feeder.target]) as prom:
        # 3+ scrapes so every rate window holds 2+ samples of moving counters (vllm:prompt_tokens_total: unified's
        # and prefill's; decode's prompt tokens are m3serve_prompt_tokens_total)
        prom.wait_until("count(count_over_time(vllm:prompt_tokens_total[30s]) >= 4)",
                        lambda v: v is not None and v >= 2, timeout_s=40)
        assert prom.wait_healthy() == ["up"]
        empty = []
        for title, ref, expr in dashboard_queries(rate_interval="30s"):
            result = prom.query(expr)
            if not has_finite_value(result):
                empty.append((title, ref, expr, result))
        assert not empty, empty
        # what the feeder recorded shows up with its labels
        roles = {r["metric"]["role"] for r in prom.query("vllm:num_requests_running")}
        assert roles == {"unified", "prefill", "decode"}
        # and the recording rules evaluate (latency and throughput)
        prom.wait_until('m3serve:ttft_seconds:p99{role="prefill"}', lambda v: v is not None and math.isfinite(v))
        p50 = prom.scalar('m3serve:ttft_seconds:p50{role="unified"}')
        assert 0.04 <= p50 <= 0.06  # every TTFT is 0.05 s: inside the (0.04, 0.06] bucket
        assert prom.scalar('m3serve:output_tokens:rate1m{model_name="tiny"}') > 0
