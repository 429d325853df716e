"""Prometheus metrics of the serving system: the only module that names metrics, labels and buckets.

Engines return plain stats dataclasses (`workers.stats`); `EngineMetrics` turns them into metrics:

    metrics = EngineMetrics(model_name="tiny", role="unified", replica="0")
    metrics.record_request(request_stats)   # latency histograms, token and outcome counters
    metrics.record_step(step_stats)         # step time, batch size
    metrics.record_steps(step_stats_list)   # the same for a tick's steps (one counter add, one gauge set)
    metrics.record_engine(engine_stats)     # gauges + cumulative counters (as deltas)
    metrics.record_transfer(transfer_stats) # KV transfer latency, size, bytes
    metrics.record_tick(tick_batch)         # all of the above for what one reporter tick read

`EngineReporter` reads that feed from one engine replica: a daemon thread that polls the engine every
`interval_s` into a `TickBatch` (plain lists) and hands it to a recorder: `EngineMetrics.record_tick` in the same
process, or, in a Serve engine replica, the replica's exporter actor (deploy/metrics_exporter.py), because
recording is per value and in the replica's process it held the GIL the step thread needs (docs/benchmarks.md S5,
S6). The gauges are re-set every tick (Ray drops a gauge that is not refreshed within ~2 s, measured on 2.60).

How the numbers reach Prometheus (decided; docs/observability.md has the scrape config):
- In a Ray Serve replica the default sink is `ray.util.metrics`. Every Ray node's metrics agent exports what
  the processes on that node recorded on the node's metrics port (`ray start --metrics-export-port=8080`), so
  one scrape target per node (the PodMonitor of the Helm chart) covers every replica. Ray puts its namespace
  in front and its OpenTelemetry pipeline drops names with a ':' (measured: `m3serve:x` never appears), so a
  metric `NAME` is registered as `m3serve_NAME` and Prometheus sees `ray_m3serve_NAME` (+ `_total` for
  counters, `_bucket/_count/_sum` for histograms), with Ray's own labels (`WorkerId`, `NodeAddress`, ...) next
  to ours. The `m3serve:` prefix of the design lives in the recording rules (`deploy/prometheus/`), where
  Prometheus convention puts colons.
- Ray re-records histogram observations at bucket midpoints on their way through the agent: `_bucket` and
  `_count` are exact, `_sum` is approximate. Throughput and byte rates therefore come from counters, and
  dashboards compute quantiles from buckets, never means from `_sum`.
- `PrometheusClientSink` writes the same exported names into a `prometheus_client` registry, for a process that
  serves its own `/metrics` (no Ray) and for exact unit tests of the feed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol

from workers.stats import EngineStats, RequestStats, StepStats, TransferStats

logger = logging.getLogger("m3serve.metrics")

__all__ = [
    "LABELS", "METRICS", "MetricSpec", "REGISTERED_PREFIX", "EXPORT_PREFIX", "spec", "exported_name",
    "request_observations", "INGRESS_METRICS", "ROUTER_METRICS", "INGRESS", "ROUTER", "EngineMetrics",
    "EngineReporter", "RayMetricsSink", "PrometheusClientSink",
    "Observer", "bind_observer", "TickBatch", "TickRecorder",
]

REGISTERED_PREFIX = "m3serve_"  # what deploy/ registers with the backend
EXPORT_PREFIX = "ray_"  # what Ray's metrics agent puts in front of every name it exports
LABELS = ("model_name", "role", "replica")

Kind = Literal["counter", "gauge", "histogram"]

# Buckets (seconds unless named otherwise). Sub-millisecond for per-token times on a GPU, minutes for
# queueing and long generations; bounded so each histogram stays at ~20-30 series per label set.
_TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                      0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TRANSFER_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                             1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TRANSFER_BYTES_BUCKETS = tuple(float(4 ** k) for k in range(6, 19))  # 4 KiB .. 64 GiB, x4 apart


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One metric: `name` without prefix; labels are `LABELS` + `extra_labels`."""

    name: str
    kind: Kind
    description: str
    extra_labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def labels(self) -> tuple[str, ...]:
        return LABELS + self.extra_labels

    @property
    def registered_name(self) -> str:
        return REGISTERED_PREFIX + self.name

    @property
    def exported_name(self) -> str:
        """The family name Prometheus sees (counters carry `_total`; histograms add `_bucket/_count/_sum`)."""
        return exported_name(self.name, self.kind)


def exported_name(name: str, kind: Kind) -> str:
    base = EXPORT_PREFIX + REGISTERED_PREFIX + name
    return base + "_total" if kind == "counter" else base


def _h(name: str, description: str, buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(name=name, kind="histogram", description=description, buckets=buckets)


def _c(name: str, description: str, extra: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name=name, kind="counter", description=description, extra_labels=extra)


def _g(name: str, description: str) -> MetricSpec:
    return MetricSpec(name=name, kind="gauge", description=description)


METRICS: tuple[MetricSpec, ...] = (
    # per request (observed once per finished request, not per failed one)
    _h("time_to_first_token_seconds", "Arrival at the engine to the first generated token.", _TTFT_BUCKETS),
    _h("inter_token_latency_seconds", "Gap between consecutive generated tokens of a request.", _TOKEN_GAP_BUCKETS),
    _h("request_time_per_output_token_seconds", "Decode time over generated tokens after the first.",
       _TOKEN_GAP_BUCKETS),
    _h("e2e_request_latency_seconds", "Arrival at the engine to the request's end.", _REQUEST_PHASE_BUCKETS),
    _h("request_queue_time_seconds", "Arrival to first scheduled (waiting queue).", _REQUEST_PHASE_BUCKETS),
    _h("request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_PHASE_BUCKETS),
    _h("request_decode_time_seconds", "First token to the request's end.", _REQUEST_PHASE_BUCKETS),
    _c("prompt_tokens", "Prompt tokens of finished requests."),
    _c("generation_tokens", "Tokens generated by finished requests."),
    _c("request_success", "Finished requests, by finish reason (stop, length; handoff on prefill).",
       ("finished_reason",)),
    _c("request_abort", "Requests aborted before they finished (the client left or cancelled): not successes."),
    _c("request_failure", "Failed requests, by reason (error, transfer, timeout, ...).", ("reason",)),
    # per KV transfer (disaggregation)
    _h("kv_transfer_seconds", "Duration of one request's KV page transfer.", _TRANSFER_SECONDS_BUCKETS),
    _h("kv_transfer_bytes", "Bytes of one request's KV page transfer.", _TRANSFER_BYTES_BUCKETS),
    _c("kv_transferred_bytes", "Bytes moved by KV transfers (exact; for GB/s)."),
    _c("kv_transfer_busy_seconds", "Seconds spent in KV transfers (exact; for GB/s)."),
    _c("kv_transfer_failures", "KV transfers that failed."),
    # per engine step
    _h("engine_step_seconds", "Wall time of one engine step.", _STEP_BUCKETS),
    _h("engine_step_host_overhead_seconds", "Part of a step spent outside the model forward.", _STEP_BUCKETS),
    _c("engine_steps", "Engine steps run."),
    # engine snapshot (gauges re-set every reporter tick; counters from cumulative engine counts)
    _g("num_requests_running", "Requests in the running batch."),
    _g("num_requests_waiting", "Requests in the waiting queue."),
    _g("kv_cache_usage_perc", "Fraction of KV pages in use by requests (0..1)."),
    _g("batch_size", "Requests in the latest engine step."),
    _c("preemptions", "Requests preempted (pages reclaimed, recomputed later)."),
    _c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    _c("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
)
_BY_NAME = {m.name: m for m in METRICS}

# The ingress's client-visible series (deploy/metrics_endpoint.py IngressMetrics records them).
INGRESS_METRICS = (
    _h("ingress_time_to_first_token_seconds", "HTTP request's arrival at the ingress to its first engine event "
       "(what a client sees, routing and queues included).", _TTFT_BUCKETS),
    _h("ingress_e2e_request_latency_seconds", "HTTP request's arrival at the ingress to its last engine event.",
       _REQUEST_PHASE_BUCKETS),
    _c("ingress_requests", "Engine requests the ingress ended, by outcome (finished, abort, error).", ("outcome",)),
)
INGRESS = {m.name: m for m in INGRESS_METRICS}

# The router's own series (deploy/metrics_endpoint.py RouterMetrics records them).
_ENGINE_REPLICA = ("engine_role", "engine_replica")
ROUTER_METRICS = (
    _c("router_requests", "Requests this router placed on each engine replica (a disaggregated request counts on "
       "its prefill and its decode replica; a retried prefill twice).", _ENGINE_REPLICA),
    MetricSpec(name="router_inflight_requests", kind="gauge", extra_labels=_ENGINE_REPLICA,
               description="Requests this router counts in flight on each engine replica (its load signal)."),
    _c("router_pd_handoffs", "Disaggregated requests by what became of the prefill -> decode handoff: ok, "
       "transfer_failed, refused (no decode room, a prefill refusal), finished_at_prefill (the first token ended "
       "it).", ("outcome",)),
    _c("router_orphans_aborted", "Direct streams whose ingress replica died holding them: aborted on their engine "
       "replica and no longer counted in flight."),
    MetricSpec(name="router_kv_pair_generation", kind="gauge", extra_labels=("pair",),
               description="Generation of each KV pair (prefill-i->decode-j) when last opened; it grows when a pair is "
               "re-wired."),
    _g("router_kv_pairs_unwired", "KV pairs missing now (an end restarted; /health is not ready while > 0)."),
)
ROUTER = {m.name: m for m in ROUTER_METRICS}


def spec(name: str) -> MetricSpec:
    """The spec of metric `name` (without prefix); KeyError names unknown metrics."""
    return _BY_NAME[name]


def request_observations(stats: RequestStats) -> dict[str, list[float]]:
    """The histogram values one finished request contributes, by metric name (pure; unit-tested).

    Definitions match `m3serve bench` for the same timestamps: TTFT = first token - arrival, ITL = gaps
    between consecutive tokens, TPOT = (end - first token) / (tokens - 1) for 2+ tokens, e2e = end - arrival.
    """
    out: dict[str, list[float]] = {}

    def put(name: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(name, []).append(max(0.0, float(value)))

    put("time_to_first_token_seconds", stats.ttft)
    put("request_time_per_output_token_seconds", stats.time_per_output_token)
    put("e2e_request_latency_seconds", stats.e2e_latency)
    put("request_queue_time_seconds", stats.queue_time)
    put("request_prefill_time_seconds", stats.prefill_time)
    put("request_decode_time_seconds", stats.decode_time)
    for gap in stats.inter_token_latencies:
        put("inter_token_latency_seconds", gap)
    return out


# -- sinks ------------------------------------------------------------------------------------------------------
class Sink(Protocol):
    def inc(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None: ...
    def set(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None: ...
    def observe(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None: ...


Observer = Callable[[float], None]


def bind_observer(sink: Any, s: MetricSpec, labels: Mapping[str, str]) -> Observer:
    """`value -> None` that observes into `s` with `labels`: the sink's own `bind` where it has one (lookups done
    once), else a plain `observe` call per value."""
    bind = getattr(sink, "bind", None)
    if bind is not None:
        return bind(s, labels)
    labels = dict(labels)
    return lambda value: sink.observe(s, value, labels)


class RayMetricsSink:
    """`ray.util.metrics` instruments, created once per process (Ray merges same-named ones per node)."""

    _lock = threading.Lock()
    _instruments: dict[str, Any] = {}

    def _get(self, s: MetricSpec) -> Any:
        with self._lock:
            inst = self._instruments.get(s.name)
            if inst is None:
                from ray.util import metrics as rm

                if s.kind == "counter":
                    inst = rm.Counter(s.registered_name, s.description, tag_keys=s.labels)
                elif s.kind == "gauge":
                    inst = rm.Gauge(s.registered_name, s.description, tag_keys=s.labels)
                else:
                    inst = rm.Histogram(s.registered_name, s.description, boundaries=list(s.buckets),
                                        tag_keys=s.labels)
                self._instruments[s.name] = inst
            return inst

    def inc(self, s: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:  # Ray refuses 0 increments
            self._get(s).inc(value, dict(labels))

    def set(self, s: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        self._get(s).set(value, dict(labels))

    def observe(self, s: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        self._get(s).observe(value, dict(labels))

    def bind(self, s: MetricSpec, labels: Mapping[str, str]) -> Observer:
        inst, tags = self._get(s), dict(labels)
        return lambda value: inst.observe(value, tags)


class PrometheusClientSink:
    """A `prometheus_client` registry; by default holding the same exported names as Ray's export.

    `name_of(spec)` picks the family name instead (without `_total`, which prometheus_client appends to counters):
    deploy/metrics_endpoint.py puts vLLM's names there for the API port's /metrics.
    """

    def __init__(self, registry: Any = None, name_of: Callable[[MetricSpec], str] | None = None) -> None:
        import prometheus_client as pc

        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self._name_of = name_of if name_of is not None else (lambda s: EXPORT_PREFIX + s.registered_name)
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _get(self, s: MetricSpec) -> Any:
        with self._lock:
            m = self._metrics.get(s.name)
            if m is None:
                import prometheus_client as pc

                name = self._name_of(s)  # prometheus_client appends `_total` to counters itself
                if s.kind == "counter":
                    m = pc.Counter(name, s.description, s.labels, registry=self.registry)
                elif s.kind == "gauge":
                    m = pc.Gauge(name, s.description, s.labels, registry=self.registry)
                else:
                    m = pc.Histogram(name, s.description, s.labels, buckets=s.buckets, registry=self.registry)
                self._metrics[s.name] = m
            return m

    def touch(self, s: MetricSpec, labels: Mapping[str, str]) -> None:
        """Create the series at zero (a counter shows from the start, not from its first increment)."""
        self._get(s).labels(**labels)

    def inc(self, s: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:
            self._get(s).labels(**labels).inc(value)

    def set(self, s: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        self._get(s).labels(**labels).set(value)

    def observe(self, s: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        self._get(s).labels(**labels).observe(value)

    def bind(self, s: MetricSpec, labels: Mapping[str, str]) -> Observer:
        return self._get(s).labels(**labels).observe

    def exposition(self) -> bytes:
        import prometheus_client as pc

        return pc.generate_latest(self.registry)


# -- the feed ---------------------------------------------------------------------------------------------------
class EngineMetrics:
    """Metrics of one engine replica; every series carries `model_name`, `role`, `replica`."""

    def __init__(self, model_name: str, role: str, replica: str | int, *, sink: Sink | None = None) -> None:
        self.labels = {"model_name": str(model_name), "role": str(role), "replica": str(replica)}
        self.sink: Sink = sink if sink is not None else RayMetricsSink()
        self._lock = threading.Lock()
        self._cumulative: dict[str, int] = {}  # last cumulative engine counts, to turn them into increments
        self._gauges: dict[str, float] = {}
        self._last_batch_size: int | None = None  # None until the engine reports steps
        self._observers: dict[str, Observer] = {}  # bound once per histogram: the label set never changes

    def _inc(self, name: str, value: float, **extra: str) -> None:
        self.sink.inc(_BY_NAME[name], value, {**self.labels, **extra})

    def _observer(self, name: str) -> Observer:
        fn = self._observers.get(name)
        if fn is None:
            fn = self._observers[name] = bind_observer(self.sink, _BY_NAME[name], self.labels)
        return fn

    def _observe(self, name: str, value: float) -> None:
        self._observer(name)(value)

    def _set(self, name: str, value: float) -> None:
        self._gauges[name] = float(value)
        self.sink.set(_BY_NAME[name], float(value), self.labels)

    def record_request(self, stats: RequestStats) -> None:
        """One finished, aborted or failed request: token counters always, one outcome counter, and latency
        histograms only for requests that finished (an abort is no success: its latencies are the client's
        choice, not the server's speed)."""
        self._inc("prompt_tokens", stats.prompt_tokens)
        self._inc("generation_tokens", stats.generation_tokens)
        if stats.failure_reason is not None:
            self._inc("request_failure", 1, reason=stats.failure_reason)
            return
        if stats.finished_reason == "abort":
            self._inc("request_abort", 1)
            return
        self._inc("request_success", 1, finished_reason=stats.finished_reason or "unknown")
        for name, values in request_observations(stats).items():
            observe = self._observer(name)
            for v in values:
                observe(v)

    def record_step(self, stats: StepStats) -> None:
        self.record_steps((stats,))

    def record_steps(self, steps: Iterable[StepStats]) -> None:
        """Steps in the order they ran: each one's histograms, one counter add for all, the last batch size."""
        steps = list(steps)
        self._record_step_times([s.step_time for s in steps], [s.host_overhead for s in steps],
                                steps[-1].batch_size if steps else None)

    def _record_step_times(self, step_times: list[float], host_overheads: list[float],
                           last_batch_size: int | None) -> None:
        step_s, host_s = self._observer("engine_step_seconds"), self._observer("engine_step_host_overhead_seconds")
        for t in step_times:
            step_s(t)
        for t in host_overheads:
            host_s(t)
        if not step_times:
            return
        self._inc("engine_steps", len(step_times))
        self._last_batch_size = last_batch_size
        self._set("batch_size", last_batch_size)

    def record_tick(self, batch: TickBatch) -> None:
        """What one reporter tick read from the engine: steps, finished requests, transfers, then the snapshot."""
        self._record_step_times(batch.step_times, batch.host_overheads, batch.last_batch_size)
        for req in batch.requests:
            self.record_request(req)
        for tr in batch.transfers:
            self.record_transfer(tr)
        if batch.engine is not None:
            self.record_engine(batch.engine)

    def record_engine(self, stats: EngineStats) -> None:
        """A snapshot: sets the gauges and adds what the cumulative engine counters grew by since the last one."""
        self._set("num_requests_running", stats.num_running)
        self._set("num_requests_waiting", stats.num_waiting)
        self._set("kv_cache_usage_perc", stats.kv_cache_usage)
        # without step stats the running batch is the best estimate of the step's batch size
        if self._last_batch_size is None or stats.num_running == 0:
            self._set("batch_size", stats.num_running)
        else:
            self._set("batch_size", self._last_batch_size)
        for name, total in (("preemptions", stats.num_preemptions),
                            ("prefix_cache_queries", stats.prefix_cache_queries),
                            ("prefix_cache_hits", stats.prefix_cache_hits)):
            self._inc(name, self._delta(name, total))

    def _delta(self, name: str, total: int) -> int:
        with self._lock:
            last = self._cumulative.get(name, 0)
            self._cumulative[name] = total
        # a smaller total means the engine restarted: everything it counted since is new
        return total - last if total >= last else total

    def record_transfer(self, stats: TransferStats) -> None:
        if not stats.ok:
            self._inc("kv_transfer_failures", 1)
            return
        self._observe("kv_transfer_seconds", stats.seconds)
        self._observe("kv_transfer_bytes", stats.num_bytes)
        self._inc("kv_transferred_bytes", stats.num_bytes)
        self._inc("kv_transfer_busy_seconds", stats.seconds)

    def refresh_gauges(self) -> None:
        """Re-set the last gauge values (Ray forgets a gauge that is not re-set within ~2 report intervals)."""
        for name, value in list(self._gauges.items()):
            self.sink.set(_BY_NAME[name], value, self.labels)


def _call_optional(source: Any, method: str) -> list[Any]:
    fn: Callable[[], Iterable[Any]] | None = getattr(source, method, None)
    return list(fn()) if fn is not None else []


@dataclass
class TickBatch:
    """What one reporter tick read from an engine, as plain lists (cheap to pickle: it may cross to the exporter
    actor). step_times / host_overheads [steps] in the order the steps ran; `last_batch_size` the last step's."""
    step_times: list[float] = field(default_factory=list)
    host_overheads: list[float] = field(default_factory=list)
    last_batch_size: int | None = None
    requests: list[RequestStats] = field(default_factory=list)
    transfers: list[TransferStats] = field(default_factory=list)
    engine: EngineStats | None = None

    @classmethod
    def read(cls, engine: Any) -> "TickBatch":
        """Pop what `engine` has for the metrics (steps, requests, transfers where it has them) and snapshot it."""
        steps = _call_optional(engine, "pop_step_stats")
        return cls(step_times=[s.step_time for s in steps], host_overheads=[s.host_overhead for s in steps],
                   last_batch_size=steps[-1].batch_size if steps else None,
                   requests=_call_optional(engine, "pop_request_stats"),
                   transfers=_call_optional(engine, "pop_transfer_stats"), engine=engine.stats())


class TickRecorder(Protocol):
    """Where a reporter's batches go: `EngineMetrics` (this process) or deploy/metrics_exporter.py's client."""

    def record_tick(self, batch: TickBatch) -> None: ...


class EngineReporter:
    """Reads an engine (`Engine` or `AsyncEngine`) into `TickBatch`es on a daemon thread for a `TickRecorder`.

    Each tick: `pop_step_stats()`, `pop_request_stats()` and `pop_transfer_stats()` where the engine has them,
    and `stats()`. `tick()` is public so a caller (or a test) can flush synchronously, e.g. right before it
    reports a request as done. The tick itself is light (pops and list building); the per-value recording is the
    recorder's, which in a Serve engine replica runs in another process.
    """

    def __init__(self, engine: Any, recorder: TickRecorder, *, interval_s: float = 0.5,
                 keep_requests: int = 4096) -> None:
        self.engine = engine
        self.recorder = recorder
        self.interval_s = interval_s
        # The engine's pop_request_stats() has one consumer (this reporter); whoever else wants the finished
        # requests (the router's admin view, tests) drains them from here.
        self._recent: deque[RequestStats] = deque(maxlen=keep_requests)
        self._stop = threading.Event()
        self._tick_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # (wall start, seconds, this thread's CPU seconds) of recent ticks: a benchmark matches a slow engine step
        # with a tick (debug_timeline); wall over CPU is time spent waiting for the GIL
        self.ticks: deque[tuple[float, float, float]] = deque(maxlen=4096)

    def tick(self) -> None:
        """Read what the engine has for the metrics and hand it to the recorder."""
        with self._tick_lock:
            wall, t0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
            batch = TickBatch.read(self.engine)
            self._recent.extend(batch.requests)
            self.recorder.record_tick(batch)
            self.ticks.append((wall, time.perf_counter() - t0, time.thread_time() - cpu0))

    def drain_requests(self) -> list[RequestStats]:
        """The finished requests recorded since the last drain (at most `keep_requests`), oldest first."""
        with self._tick_lock:
            out = list(self._recent)
            self._recent.clear()
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # a metrics hiccup must never take the replica down
                logger.exception("metrics tick failed")
    def start(self) -> "EngineReporter":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="m3serve-metrics", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, flush: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None
        if flush:
            self.tick()
