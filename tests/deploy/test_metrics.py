"""deploy/metrics.py: names, buckets, and the exact values the stats feed records (prometheus_client sink)."""
from __future__ import annotations

import re

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.utils import floatToGoString  # noqa: E402

from deploy.bench import RequestResult  # noqa: E402
from deploy.metrics import (  # noqa: E402
    LABELS, METRICS, EngineMetrics, PrometheusClientSink, exported_name, request_observations, spec,
)
from workers.stats import EngineStats, RequestStats, StepStats, TransferStats  # noqa: E402

REQUIRED = {
    "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds",
                  "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                  "kv_transfer_seconds", "kv_transfer_bytes", "engine_step_seconds"],
    "counter": ["prompt_tokens", "generation_tokens", "request_success", "request_failure", "preemptions",
                "prefix_cache_queries", "prefix_cache_hits"],
    "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "batch_size"],
}

# A request with known timestamps: arrives at 100.0, scheduled at 100.25, tokens at 100.5, 100.6, 100.8, 101.1,
# ends with the last token.
ARRIVAL, SCHEDULED = 100.0, 100.25
TOKEN_TIMES = [100.5, 100.6, 100.8, 101.1]


def _request(**kw) -> RequestStats:
    base = dict(request_id="r1", prompt_tokens=7, generation_tokens=len(TOKEN_TIMES), finished_reason="length",
                arrival_time=ARRIVAL, first_scheduled_time=SCHEDULED, first_token_time=TOKEN_TIMES[0],
                finished_time=TOKEN_TIMES[-1], token_times=list(TOKEN_TIMES))
    base.update(kw)
    return RequestStats(**base)


def _sample(sink: PrometheusClientSink, name: str, **labels) -> float | None:
    return sink.registry.get_sample_value(name, labels)


def _labels(**extra) -> dict[str, str]:
    return {"model_name": "tiny", "role": "unified", "replica": "0", **extra}


def test_every_required_metric_is_declared_with_its_kind():
    for kind, names in REQUIRED.items():
        for name in names:
            assert spec(name).kind == kind, name
    assert len({m.name for m in METRICS}) == len(METRICS)


def test_names_survive_rays_export_and_buckets_are_increasing():
    ray_name = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # Ray 2.60 drops names with ':' (measured)
    for m in METRICS:
        assert ray_name.match(m.registered_name), m.registered_name
        assert m.labels[:3] == LABELS
        if m.kind == "histogram":
            assert len(m.buckets) >= 10 and all(b > 0 for b in m.buckets)
            assert list(m.buckets) == sorted(set(m.buckets)), m.name
    # sub-millisecond token gaps and many-minute requests both land in a finite bucket
    assert spec("inter_token_latency_seconds").buckets[0] <= 0.0005
    assert spec("e2e_request_latency_seconds").buckets[-1] >= 600
    assert exported_name("prompt_tokens", "counter") == "ray_m3serve_prompt_tokens_total"
    assert spec("time_to_first_token_seconds").exported_name == "ray_m3serve_time_to_first_token_seconds"


def test_request_observations_follow_the_definitions():
    obs = request_observations(_request())
    assert obs["time_to_first_token_seconds"] == [pytest.approx(0.5)]
    assert obs["request_queue_time_seconds"] == [pytest.approx(0.25)]
    assert obs["request_prefill_time_seconds"] == [pytest.approx(0.25)]
    assert obs["request_decode_time_seconds"] == [pytest.approx(0.6)]
    assert obs["e2e_request_latency_seconds"] == [pytest.approx(1.1)]
    assert obs["request_time_per_output_token_seconds"] == [pytest.approx(0.6 / 3)]
    assert obs["inter_token_latency_seconds"] == pytest.approx([0.1, 0.2, 0.3])
    # one token: no TPOT, no ITL; never scheduled: no queue/prefill time
    one = request_observations(_request(generation_tokens=1, token_times=[100.5], finished_time=100.5,
                                       first_scheduled_time=None))
    assert "request_time_per_output_token_seconds" not in one and "inter_token_latency_seconds" not in one
    assert "request_queue_time_seconds" not in one and "request_prefill_time_seconds" not in one


def test_engine_metrics_agree_with_the_bench_client_on_the_same_timestamps():
    """The server-side histograms and the bench client measure TTFT/TPOT/ITL/e2e identically."""
    client = RequestResult(success=True, start=ARRIVAL, end=TOKEN_TIMES[-1], chunk_times=list(TOKEN_TIMES),
                           output_tokens=len(TOKEN_TIMES), prompt_tokens=7)
    sink = PrometheusClientSink()
    EngineMetrics("tiny", "unified", 0, sink=sink).record_request(_request())
    pairs = {"time_to_first_token_seconds": [client.ttft],
             "request_time_per_output_token_seconds": [client.tpot],
             "inter_token_latency_seconds": client.itl,
             "e2e_request_latency_seconds": [client.e2e]}
    for name, values in pairs.items():
        fam = spec(name).exported_name
        assert _sample(sink, fam + "_count", **_labels()) == len(values), name
        assert _sample(sink, fam + "_sum", **_labels()) == pytest.approx(sum(values)), name


def test_record_request_counts_success_failure_and_tokens():
    sink = PrometheusClientSink()
    m = EngineMetrics("tiny", "unified", 0, sink=sink)
    m.record_request(_request())
    m.record_request(_request(request_id="r2", finished_reason="stop", prompt_tokens=3, generation_tokens=2,
                              token_times=[100.5, 100.7], finished_time=100.7))
    m.record_request(_request(request_id="r3", failure_reason="transfer", generation_tokens=0, token_times=[],
                              first_token_time=None, finished_time=None, prompt_tokens=5))
    # an abort is no success (issue 21): counted as aborted, its tokens counted, no latency observed
    m.record_request(_request(request_id="r4", finished_reason="abort", prompt_tokens=4, generation_tokens=1,
                              token_times=[100.5], finished_time=100.9))
    assert _sample(sink, "ray_m3serve_prompt_tokens_total", **_labels()) == 19
    assert _sample(sink, "ray_m3serve_generation_tokens_total", **_labels()) == 7
    assert _sample(sink, "ray_m3serve_request_abort_total", **_labels()) == 1
    assert _sample(sink, "ray_m3serve_request_success_total", **_labels(finished_reason="abort")) is None
    assert _sample(sink, "ray_m3serve_request_success_total", **_labels(finished_reason="length")) == 1
    assert _sample(sink, "ray_m3serve_request_success_total", **_labels(finished_reason="stop")) == 1
    assert _sample(sink, "ray_m3serve_request_failure_total", **_labels(reason="transfer")) == 1
    # the failed request adds no latency observation
    assert _sample(sink, "ray_m3serve_time_to_first_token_seconds_count", **_labels()) == 2
    assert _sample(sink, "ray_m3serve_inter_token_latency_seconds_count", **_labels()) == 3 + 1
    # the 0.5 s TTFTs sit in the 0.5 bucket and not in the 0.25 one
    ttft = "ray_m3serve_time_to_first_token_seconds_bucket"
    assert _sample(sink, ttft, **_labels(le="0.25")) == 0
    assert _sample(sink, ttft, **_labels(le="0.5")) == 2


def test_record_engine_sets_gauges_and_turns_cumulative_counts_into_increments():
    sink = PrometheusClientSink()
    m = EngineMetrics("tiny", "decode", "3", sink=sink)
    lab = {"model_name": "tiny", "role": "decode", "replica": "3"}
    m.record_engine(EngineStats(role="decode", num_running=2, num_waiting=5, num_pages_total=100,
                                num_pages_free=75, prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1))
    assert _sample(sink, "ray_m3serve_num_requests_running", **lab) == 2
    assert _sample(sink, "ray_m3serve_num_requests_waiting", **lab) == 5
    assert _sample(sink, "ray_m3serve_kv_cache_usage_perc", **lab) == pytest.approx(0.25)
    assert _sample(sink, "ray_m3serve_batch_size", **lab) == 2  # no step stats yet: the running batch
    m.record_step(StepStats(step_time=0.02, host_overhead=0.004, batch_size=4, num_decode_tokens=4))
    assert _sample(sink, "ray_m3serve_batch_size", **lab) == 4
    assert _sample(sink, "ray_m3serve_engine_step_seconds_count", **lab) == 1
    m.record_engine(EngineStats(role="decode", num_running=4, prefix_cache_queries=50, prefix_cache_hits=20,
                                num_preemptions=3, num_pages_total=100, num_pages_free=100))
    assert _sample(sink, "ray_m3serve_prefix_cache_queries_total", **lab) == 50
    assert _sample(sink, "ray_m3serve_prefix_cache_hits_total", **lab) == 20
    assert _sample(sink, "ray_m3serve_preemptions_total", **lab) == 3
    # engine restarted: its counts start again from 0, and what it counted since is new
    m.record_engine(EngineStats(role="decode", prefix_cache_queries=8, prefix_cache_hits=2, num_preemptions=0))
    assert _sample(sink, "ray_m3serve_prefix_cache_queries_total", **lab) == 58
    assert _sample(sink, "ray_m3serve_prefix_cache_hits_total", **lab) == 22
    assert _sample(sink, "ray_m3serve_batch_size", **lab) == 0  # idle engine


class _CallLog:
    """A sink without `bind`: records every call, so the feed's fallback and its call counts are visible."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    def inc(self, s, value, labels):
        self.calls.append(("inc", s.name, value))

    def set(self, s, value, labels):
        self.calls.append(("set", s.name, value))

    def observe(self, s, value, labels):
        self.calls.append(("observe", s.name, value))


def test_record_steps_observes_each_step_and_counts_them_in_one_add():
    """A tick's steps: both histograms get every step (bound observers, through a tee to two kinds of sink), the
    step counter one add for the lot, the batch gauge the last step's size."""
    from deploy.metrics_endpoint import TeeSink

    prom, log = PrometheusClientSink(), _CallLog()
    m = EngineMetrics("tiny", "unified", 0, sink=TeeSink(prom, log))
    steps = [StepStats(step_time=t, host_overhead=t / 4, batch_size=b, num_decode_tokens=b)
             for t, b in ((0.001, 1), (0.004, 3), (0.5, 2))]
    m.record_steps(steps)
    m.record_steps([])  # an idle tick records nothing
    lab = _labels()
    assert _sample(prom, "ray_m3serve_engine_step_seconds_count", **lab) == 3
    assert _sample(prom, "ray_m3serve_engine_step_seconds_sum", **lab) == pytest.approx(0.505)
    assert _sample(prom, "ray_m3serve_engine_step_host_overhead_seconds_sum", **lab) == pytest.approx(0.505 / 4)
    assert _sample(prom, "ray_m3serve_engine_step_seconds_bucket", **lab, le=floatToGoString(0.005)) == 2
    assert _sample(prom, "ray_m3serve_engine_steps_total", **lab) == 3
    assert _sample(prom, "ray_m3serve_batch_size", **lab) == 2
    assert [c for c in log.calls if c[0] != "observe"] == [("inc", "engine_steps", 3), ("set", "batch_size", 2)]
    assert [v for kind, name, v in log.calls if name == "engine_step_seconds"] == [0.001, 0.004, 0.5]
    m.record_step(StepStats(step_time=0.002, host_overhead=0.0, batch_size=5, num_decode_tokens=5))
    assert _sample(prom, "ray_m3serve_engine_steps_total", **lab) == 4
    assert _sample(prom, "ray_m3serve_batch_size", **lab) == 5


def test_a_tick_batch_records_what_the_direct_feed_records():
    """A reporter tick pops the engine into a TickBatch of plain lists (what crosses to the exporter actor) and
    records it; the samples equal feeding the same stats one call at a time, and a second tick adds nothing."""
    import pickle

    import deploy.metrics as dm

    steps = [StepStats(step_time=0.002 * (i + 1), host_overhead=0.0005, batch_size=i + 1, num_decode_tokens=1)
             for i in range(5)]
    transfer = TransferStats(request_id="r1", num_bytes=4096, seconds=0.001, num_pages=1)
    snapshot = EngineStats(num_running=2, num_pages_total=10, num_pages_free=4, prefix_cache_queries=9)

    class Engine:
        def __init__(self) -> None:
            self.steps, self.requests, self.transfers = list(steps), [_request()], [transfer]

        def pop_step_stats(self):
            out, self.steps = self.steps, []
            return out

        def pop_request_stats(self):
            out, self.requests = self.requests, []
            return out

        def pop_transfer_stats(self):
            out, self.transfers = self.transfers, []
            return out

        def stats(self):
            return snapshot

    def samples(sink):
        return sorted((m.name, tuple(sorted(s.labels.items())), s.value) for m in sink.registry.collect()
                      for s in m.samples if not s.name.endswith("_created"))

    batch = dm.TickBatch.read(Engine())
    assert batch.step_times == [s.step_time for s in steps] and batch.last_batch_size == 5
    assert pickle.loads(pickle.dumps(batch)) == batch
    via_tick = PrometheusClientSink()
    reporter = dm.EngineReporter(Engine(), EngineMetrics("tiny", "unified", 0, sink=via_tick))
    reporter.tick()
    direct = PrometheusClientSink()
    m = EngineMetrics("tiny", "unified", 0, sink=direct)
    m.record_steps(steps)
    m.record_request(_request())
    m.record_transfer(transfer)
    m.record_engine(snapshot)
    assert samples(via_tick) == samples(direct)
    assert _sample(via_tick, "ray_m3serve_engine_steps_total", **_labels()) == 5
    assert _sample(via_tick, "ray_m3serve_batch_size", **_labels()) == 5
    reporter.tick()  # nothing new popped: only the snapshot again
    assert samples(via_tick) == samples(direct)
    assert [r.request_id for r in reporter.drain_requests()] == ["r1"]


def test_record_transfer_counts_bytes_exactly():
    sink = PrometheusClientSink()
    m = EngineMetrics("tiny", "prefill", 0, sink=sink)
    lab = {"model_name": "tiny", "role": "prefill", "replica": "0"}
    m.record_transfer(TransferStats(request_id="a", num_bytes=3 << 20, seconds=0.002, num_pages=6))
    m.record_transfer(TransferStats(request_id="b", num_bytes=1 << 20, seconds=0.001, num_pages=2))
    m.record_transfer(TransferStats(request_id="c", num_bytes=0, seconds=0.5, num_pages=2, ok=False))
    assert _sample(sink, "ray_m3serve_kv_transferred_bytes_total", **lab) == 4 << 20
    assert _sample(sink, "ray_m3serve_kv_transfer_busy_seconds_total", **lab) == pytest.approx(0.003)
    assert _sample(sink, "ray_m3serve_kv_transfer_failures_total", **lab) == 1
    assert _sample(sink, "ray_m3serve_kv_transfer_seconds_count", **lab) == 2
    assert _sample(sink, "ray_m3serve_kv_transfer_bytes_bucket", **lab, le=floatToGoString(4 ** 10)) == 1
    assert _sample(sink, "ray_m3serve_kv_transfer_bytes_bucket", **lab, le=floatToGoString(4 ** 11)) == 2


def test_exposition_is_prometheus_text():
    sink = PrometheusClientSink()
    EngineMetrics("tiny", "unified", 0, sink=sink).record_request(_request())
    text = sink.exposition().decode()
    assert "# TYPE ray_m3serve_time_to_first_token_seconds histogram" in text
    assert 'ray_m3serve_request_success_total{finished_reason="length",model_name="tiny"' in text


# -- the Ray export path (real Ray, in a subprocess so it never meets the session's Serve cluster) -------------
_RAY_SCRIPT = r'''
import asyncio, json, os, sys, time, urllib.request
import ray
from deploy.metrics import RayMetricsSink, TickBatch
from deploy.metrics_exporter import start_exporter
from workers.stats import EngineStats, RequestStats, TransferStats

port = int(sys.argv[1])
ray.init(address="local", num_cpus=1, object_store_memory=256 * 2**20, include_dashboard=False,
         _metrics_export_port=port, log_to_driver=False, configure_logging=False)

@ray.remote(num_cpus=0.1)
class Replica:
    # stands in for an engine replica: its batches go to an exporter actor (deploy/metrics_exporter.py)
    def __init__(self):
        self.client = start_exporter("tiny", "decode", "7")

    def feed(self, requests, engine, transfer):
        self.client.record_tick(TickBatch(requests=[RequestStats(**r) for r in requests],
                                          transfers=[TransferStats(**transfer)], engine=EngineStats(**engine)))
        self.snapshot = EngineStats(**engine)
        # nothing was recorded in this process: no Ray instrument was made here
        return {"in_process": self.client.in_process, "instruments": sorted(RayMetricsSink._instruments)}

    def refresh(self):
        self.client.record_tick(TickBatch(engine=self.snapshot))  # gauges vanish unless re-set

    def counts(self):
        fams = asyncio.run(self.client.families())
        return {s.name: s.value for f in fams for s in f.samples if s.name.endswith(("_total", "_count"))}

    def lose_exporter(self, requests):
        ray.kill(self.client._actor)
        time.sleep(1)
        self.client.record_tick(TickBatch(requests=[RequestStats(**r) for r in requests]))  # sent, never run
        before = self.client.in_process
        ray.wait([self.client._pending[-1][0]], timeout=30)  # its failure is known
        self.client.record_tick(TickBatch(requests=[RequestStats(**r) for r in requests]))  # finds it gone
        return {"before": before, "after": self.client.in_process}

spec = json.loads(sys.stdin.read())
rep = Replica.remote()
print("FEED", json.dumps(ray.get(rep.feed.remote(spec["requests"], spec["engine"], spec["transfer"]))))
deadline = time.monotonic() + 60
text = ""
while time.monotonic() < deadline:
    ray.get(rep.refresh.remote())
    time.sleep(0.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    if ("ray_m3serve_time_to_first_token_seconds_count" in text and "ray_m3serve_num_requests_running" in text
            and "ray_m3serve_kv_transfer_bytes_count" in text and "ray_m3serve_request_failure_total" in text):
        break
print("\n".join(l for l in text.splitlines() if "m3serve" in l and not l.startswith("#")))
print("COUNTS", json.dumps(ray.get(rep.counts.remote())))
print("LOCAL", json.dumps(ray.get(rep.lose_exporter.remote(spec["requests"][:1]))))
print("COUNTS_AFTER", json.dumps(ray.get(rep.counts.remote())))
ray.shutdown()
'''


def test_ray_export_names_labels_and_exact_counts(tmp_path):
    """Through an exporter actor and Ray's metrics agent: names `ray_m3serve_*`, our labels, exact counters and
    bucket counts; the replica's registry held by the exporter, and recording in the replica once it dies."""
    import json
    import os
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families
    from tests.deploy.promhelp import free_port

    requests = [dict(request_id=f"r{i}", role="decode", prompt_tokens=7 + i, generation_tokens=4,
                     finished_reason="stop", arrival_time=ARRIVAL, first_scheduled_time=SCHEDULED,
                     first_token_time=TOKEN_TIMES[0], finished_time=TOKEN_TIMES[-1], token_times=TOKEN_TIMES)
                for i in range(3)]
    requests.append(dict(request_id="bad", role="decode", prompt_tokens=2, failure_reason="timeout"))
    engine = dict(role="decode", num_running=3, num_waiting=1, num_pages_total=8, num_pages_free=2,
                  prefix_cache_queries=30, prefix_cache_hits=12)
    transfer = dict(request_id="r0", num_bytes=5000, seconds=0.003, num_pages=2)
    port = free_port()
    env = {**os.environ, "RAY_metrics_report_interval_ms": "500", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", _RAY_SCRIPT, str(port)], input=json.dumps(
        {"requests": requests, "engine": engine, "transfer": transfer}), capture_output=True, text=True,
        timeout=150, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tagged = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
              if line.split(" ", 1)[0] in ("FEED", "COUNTS", "LOCAL", "COUNTS_AFTER")}
    exported = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("ray_"))
    samples = {}
    for fam in text_string_to_metric_families(exported):
        for s in fam.samples:
            assert {"model_name": "tiny", "role": "decode", "replica": "7"}.items() <= s.labels.items(), s
            key = (s.name, s.labels.get("le"), s.labels.get("finished_reason") or s.labels.get("reason"))
            samples[key] = samples.get(key, 0.0) + s.value
    assert samples[("ray_m3serve_request_success_total", None, "stop")] == 3
    assert samples[("ray_m3serve_request_failure_total", None, "timeout")] == 1
    assert samples[("ray_m3serve_prompt_tokens_total", None, None)] == 7 + 8 + 9 + 2
    assert samples[("ray_m3serve_generation_tokens_total", None, None)] == 12
    assert samples[("ray_m3serve_time_to_first_token_seconds_count", None, None)] == 3
    assert samples[("ray_m3serve_inter_token_latency_seconds_count", None, None)] == 9
    ttft_le = "0.5"  # TTFT 0.5 s: counted at le=0.5, not at le=0.25
    assert samples[("ray_m3serve_time_to_first_token_seconds_bucket", ttft_le, None)] == 3
    assert samples[("ray_m3serve_time_to_first_token_seconds_bucket", "0.25", None)] == 0
    # Ray re-records observations at bucket midpoints: the sum is approximate, within the bucket's width
    assert 3 * 0.25 <= samples[("ray_m3serve_time_to_first_token_seconds_sum", None, None)] <= 3 * 0.5
    assert samples[("ray_m3serve_kv_transferred_bytes_total", None, None)] == 5000
    assert samples[("ray_m3serve_kv_transfer_bytes_count", None, None)] == 1
    assert samples[("ray_m3serve_num_requests_running", None, None)] == 3
    assert samples[("ray_m3serve_kv_cache_usage_perc", None, None)] == pytest.approx(0.75)
    assert samples[("ray_m3serve_prefix_cache_hits_total", None, None)] == 12
    # recorded in the exporter's process (deploy/metrics_exporter.py), none in the replica's
    assert tagged["FEED"] == {"in_process": False, "instruments": []}
    # the replica's own registry (the API port's /metrics) is the exporter's too
    assert tagged["COUNTS"]["vllm:generation_tokens_total"] == 12
    assert tagged["COUNTS"]["m3serve_time_to_first_token_seconds_count"] == 3
    # the exporter died after a batch was sent to it: that batch and the later ones are recorded in the replica's
    # process (its series start again, as after a replica restart)
    assert tagged["LOCAL"] == {"before": False, "after": True}
    assert tagged["COUNTS_AFTER"]["vllm:generation_tokens_total"] == 4 + 4
    assert tagged["COUNTS_AFTER"]["m3serve_time_to_first_token_seconds_count"] == 2


def test_reporter_feeds_metrics_from_a_real_engine_and_keeps_requests_for_others(tmp_path):
    """EngineReporter against the real CPU engine on the tiny model: one request's stats reach the metrics."""
    engine_mod = pytest.importorskip("workers.engine")
    from deploy.metrics import EngineReporter
    from workers.config import EngineConfig
    from workers.models import tiny_model_dir
    from workers.request import SamplingParams

    engine = engine_mod.Engine(str(tiny_model_dir()), engine_config=EngineConfig(max_model_len=64, num_pages=32),
                               device="cpu")
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sink = PrometheusClientSink()
    reporter = EngineReporter(engine, EngineMetrics("tiny", "unified", 0, sink=sink))
    reporter.tick()
    assert _sample(sink, "ray_m3serve_prompt_tokens_total", **_labels()) == 4
    assert _sample(sink, "ray_m3serve_generation_tokens_total", **_labels()) == 3
    assert _sample(sink, "ray_m3serve_time_to_first_token_seconds_count", **_labels()) == 1
    assert _sample(sink, "ray_m3serve_inter_token_latency_seconds_count", **_labels()) == 2
    assert _sample(sink, "ray_m3serve_engine_step_seconds_count", **_labels()) >= 3
    assert _sample(sink, "ray_m3serve_num_requests_running", **_labels()) == 0
    assert [r.request_id for r in reporter.drain_requests()] == ["a"]
    assert reporter.drain_requests() == []
    reporter.tick()  # nothing new: counters unchanged
    assert _sample(sink, "ray_m3serve_generation_tokens_total", **_labels()) == 3
    assert len(reporter.ticks) == 2 and all(secs >= 0 and cpu >= 0 for _, secs, cpu in reporter.ticks)  # timed
