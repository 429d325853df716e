"""The main job's own `/metrics` on the API port: every replica's series, under vLLM's names (issue 21).

Where the series come from:
- each engine replica (`EngineServer`) records its `EngineMetrics` into two sinks (`replica_sinks`): Ray's
  (`ray_m3serve_*` on Ray's per-node export port, what the Helm PodMonitor scrapes) and its own
  `prometheus_client` registry (`ReplicaExport`) under the names below; `EngineServer.metrics_families` hands
  that registry's families to whoever asks;
- the ingress measures what the client sees (`RequestTiming`: from the HTTP request's arrival at the ingress,
  stamped by `ArrivalStamp`, to the first engine event and to the end) into its own registry (`IngressMetrics`);
- each router replica counts what it routed where, its in-flight requests per engine replica, PD handoff
  outcomes, the streams of dead ingress replicas it aborted and its KV pairs (`RouterMetrics`);
- ingress and router replicas cannot be addressed one by one through Serve handles, so each pushes its families
  to the app's `MetricsHub` every second (deploy/metrics_hub.py).

`gather` collects the ingress's registries, every other ingress's and router's latest families from the hub, and
every engine replica's families through Serve handles, and
`exposition` renders them in the format the scraper's Accept header asks for (Prometheus text 0.0.4, or
OpenMetrics). Merging concatenates samples and never adds them: every replica's series carry its own `role` and
`replica` labels, so the same series from two sources can only be a duplicate (kept once, `merge_families`).

Names (decided): what vLLM measures carries vLLM's name (`VLLM_NAMES`, `vllm:` + name), so vLLM dashboards,
recording rules and autoscalers (KEDA, llm-d, production-stack) work unchanged; everything else is
`m3serve_<name>`. With disaggregation a request passes two engines; the `vllm:` families count each request
once: prefill's (and unified's) engines answer for the prompt side (TTFT, queue, prefill time, prompt tokens),
decode's (and unified's) for the output side (e2e, TPOT, ITL, decode time, generation tokens, successes). A role's
other per-request series go under `m3serve_<name>` instead, so nothing is lost and `sum(vllm:...)` over roles is
what a client saw, once.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import re
import time
from typing import Any, Iterable

from deploy.metrics import (INGRESS, INGRESS_METRICS, REGISTERED_PREFIX, ROUTER, ROUTER_METRICS, MetricSpec,
                            Observer, PrometheusClientSink, RayMetricsSink, Sink, bind_observer)

logger = logging.getLogger("m3serve.metrics")

__all__ = ["VLLM_NAMES", "own_name", "TeeSink", "ReplicaExport", "replica_sinks", "IngressMetrics",
           "RouterMetrics", "RequestTiming", "ArrivalStamp", "merge_families", "exposition", "gather"]

VLLM_PREFIX = "vllm:"
VLLM_NAMES = {  # our metric name -> vLLM's (counters without `_total`: prometheus_client appends it)
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "request_time_per_output_token_seconds": "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "request_prefill_time_seconds": "request_prefill_time_seconds",
    "request_decode_time_seconds": "request_decode_time_seconds",
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "request_success",
    "preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
}
# Per-request series of the prompt side and of the output side (see the module docstring).
_PROMPT_SIDE = {"time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                "prompt_tokens"}
_OUTPUT_SIDE = {"inter_token_latency_seconds", "request_time_per_output_token_seconds",
                "e2e_request_latency_seconds", "request_decode_time_seconds", "generation_tokens",
                "request_success"}


def own_name(s: MetricSpec, role: str) -> str:
    """The family name (counters without `_total`) of `s` on the API port's /metrics for an engine of `role`:
    vLLM's where vLLM measures it and this role answers for it, else `m3serve_<name>`."""
    vllm = VLLM_NAMES.get(s.name)
    skip = _OUTPUT_SIDE if role == "prefill" else _PROMPT_SIDE if role == "decode" else set()
    if vllm is None or s.name in skip:
        return REGISTERED_PREFIX + s.name
    return VLLM_PREFIX + vllm


class TeeSink:
    """Every record goes to each of `sinks` (one failing sink does not starve the others of later records)."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def inc(self, s: MetricSpec, value: float, labels) -> None:
        for sink in self.sinks:
            sink.inc(s, value, labels)

    def set(self, s: MetricSpec, value: float, labels) -> None:
        for sink in self.sinks:
            sink.set(s, value, labels)

    def observe(self, s: MetricSpec, value: float, labels) -> None:
        for sink in self.sinks:
            sink.observe(s, value, labels)

    def bind(self, s: MetricSpec, labels) -> Observer:
        observers = tuple(bind_observer(sink, s, labels) for sink in self.sinks)

        def observe(value: float) -> None:
            for fn in observers:
                fn(value)
        return observe


class ReplicaExport:
    """One replica's own registry, under `own_name`; `families()` is what /metrics gathers from it."""

    def __init__(self, role: str) -> None:
        self.sink = PrometheusClientSink(name_of=lambda s: own_name(s, role))

    def families(self) -> list:
        """The registry's metric families (prometheus_client `Metric`s: plain, picklable objects)."""
        return list(self.sink.registry.collect())


def replica_sinks(role: str, *, ray: bool = True) -> tuple[TeeSink, ReplicaExport]:
    """The sink an engine replica's `EngineMetrics` records into (Ray's export and its own registry), and the
    registry's export. The `ray_m3serve_*` copies stay: Ray's per-node port is what a cluster scrape and the Helm
    PodMonitor read, and it reaches replicas that no ingress can (another app's, a wedged ingress)."""
    export = ReplicaExport(role)
    sinks: list[Sink] = [RayMetricsSink()] if ray else []
    return TeeSink(*sinks, export.sink), export


# -- client-visible latency, measured at the ingress (the specs: deploy/metrics.py INGRESS_METRICS) -----------
_ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("m3serve_arrival", default=None)


class ArrivalStamp:
    """Pure ASGI middleware: stamps each HTTP request's arrival (time.monotonic()) into a context variable that
    the request's handler (and the `RequestTiming`s it starts) reads. Pure ASGI, not BaseHTTPMiddleware: it
    wraps neither `receive` nor `send`, so client disconnects reach the handler unchanged."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        token = _ARRIVAL.set(time.monotonic())
        try:
            await self.app(scope, receive, send)
        finally:
            _ARRIVAL.reset(token)


def _replica_tag() -> str:
    """This Serve replica's tag ("0" outside Serve: a unit test)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return "0"


INGRESS_OUTCOMES = ("finished", "abort", "error")


class IngressMetrics:
    """The ingress replica's client-visible series: `m3serve_ingress_*` in its own registry (and Ray's)."""

    current: "IngressMetrics | None" = None  # this process's, set by `install`; None = record nothing

    def __init__(self, model_name: str, replica: str, *, ray: bool = True) -> None:
        self.labels = {"model_name": model_name, "role": "ingress", "replica": replica}
        self.export = PrometheusClientSink(name_of=lambda s: REGISTERED_PREFIX + s.name)
        self.sink = TeeSink(RayMetricsSink(), self.export) if ray else TeeSink(self.export)
        for outcome in INGRESS_OUTCOMES:  # every replica shows from its start, with or without requests
            self.export.touch(INGRESS["ingress_requests"], {**self.labels, "outcome": outcome})

    @classmethod
    def install(cls, model_name: str, replica: str | None = None, *, ray: bool = True) -> "IngressMetrics":
        """This process's ingress metrics; `replica` defaults to the Serve replica's tag ("0" outside Serve). In a
        Serve replica its families go to the app's metrics hub every second (the other ingress replicas' scrapes
        show them)."""
        from deploy.metrics_hub import start_pushing

        cls.current = metrics = cls(model_name, replica or _replica_tag(), ray=ray)
        start_pushing(f"ingress-{metrics.labels['replica']}", metrics.families)
        return metrics

    def families(self) -> list:
        return list(self.export.registry.collect())

    def record(self, ttft: float | None, e2e: float | None, outcome: str) -> None:
        try:
            self.sink.inc(INGRESS["ingress_requests"], 1, {**self.labels, "outcome": outcome})
            if outcome == "finished":  # like the engines': latencies only of requests that finished
                if ttft is not None:
                    self.sink.observe(INGRESS["ingress_time_to_first_token_seconds"], ttft, self.labels)
                if e2e is not None:
                    self.sink.observe(INGRESS["ingress_e2e_request_latency_seconds"], e2e, self.labels)
        except Exception:  # metrics must never fail a request
            logger.exception("ingress metrics")


# -- the router's own series (the specs: deploy/metrics.py ROUTER_METRICS) ------------------------------------
class RouterMetrics:
    """One router replica's series (`m3serve_router_*`, role `router`, replica = its Serve replica tag), in its own
    registry and Ray's. The gauges are set from the router's state each time the families are collected."""

    def __init__(self, model_name: str, replica: str | None = None, *, ray: bool = True) -> None:
        self.labels = {"model_name": model_name, "role": "router", "replica": replica or _replica_tag()}
        self.export = PrometheusClientSink(name_of=lambda s: REGISTERED_PREFIX + s.name)
        self.sink = TeeSink(RayMetricsSink(), self.export) if ray else TeeSink(self.export)

    def _engine(self, key: tuple[str, int]) -> dict[str, str]:
        return {**self.labels, "engine_role": key[0], "engine_replica": str(key[1])}

    def routed(self, key: tuple[str, int]) -> None:
        self._safely(self.sink.inc, ROUTER["router_requests"], 1, self._engine(key))

    def handoff(self, outcome: str) -> None:
        self._safely(self.sink.inc, ROUTER["router_pd_handoffs"], 1, {**self.labels, "outcome": outcome})

    def orphans_aborted(self, count: int) -> None:
        self._safely(self.sink.inc, ROUTER["router_orphans_aborted"], count, self.labels)

    def families(self, inflight: dict[tuple[str, int], int], pairs: dict[str, int], unwired: int) -> list:
        """The registry's families after setting the gauges from `inflight` (per engine replica), `pairs` (open
        pair -> generation) and `unwired` (pairs missing)."""
        for key, count in inflight.items():
            self.export.touch(ROUTER["router_requests"], self._engine(key))
            self._safely(self.sink.set, ROUTER["router_inflight_requests"], count, self._engine(key))
        for pair, gen in pairs.items():
            self._safely(self.sink.set, ROUTER["router_kv_pair_generation"], gen, {**self.labels, "pair": pair})
        if pairs or unwired:
            self._safely(self.sink.set, ROUTER["router_kv_pairs_unwired"], unwired, self.labels)
        return list(self.export.registry.collect())

    @staticmethod
    def _safely(record, *args) -> None:
        try:
            record(*args)
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            logger.exception("router metrics")


class RequestTiming:
    """One engine request as the ingress sees it. `first_event()` when its first engine event arrived,
    `end(outcome)` once (later calls are ignored): records into `IngressMetrics.current`, if any."""

    def __init__(self) -> None:
        self.arrival = _ARRIVAL.get() or time.monotonic()  # outside an HTTP request: from now
        self.first: float | None = None
        self.ended = False

    def first_event(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def end(self, outcome: str) -> None:
        if self.ended:
            return
        self.ended = True
        metrics = IngressMetrics.current
        if metrics is not None:
            now = time.monotonic()
            metrics.record(None if self.first is None else self.first - self.arrival, now - self.arrival, outcome)


# -- gathering and merging ------------------------------------------------------------------------------------
def merge_families(sources: Iterable[Iterable[Any]]) -> list:
    """One list of prometheus_client families from several sources' families: families of the same name become
    one (type and help of the first), samples are concatenated, never added; a sample whose name and labels
    already came from an earlier source is a duplicate and dropped (counting it would count twice)."""
    from prometheus_client.metrics_core import Metric

    merged: dict[str, Metric] = {}
    seen: set[tuple] = set()
    for families in sources:
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for sample in fam.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in seen:
                    logger.warning("duplicate series %s %s dropped", sample.name, sample.labels)
                    continue
                seen.add(key)
                out.samples.append(sample)
    return list(merged.values())


class _Families:
    """A collector serving fixed families (prometheus_client's encoders read registries)."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self) -> list:
        return self._families


def exposition(families: list, accept: str | None) -> tuple[bytes, str]:
    """(body, content type) of `families` in the format `accept` asks for: OpenMetrics when it names
    `application/openmetrics-text`, else Prometheus text 0.0.4 (prometheus_client's own negotiation)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    encoder, content_type = choose_encoder(accept or "")
    if content_type.startswith("application/openmetrics-text") and isinstance(encoder, functools.partial):
        # prometheus_client's default "underscores" escaping rewrites ':' in sample names (not in HELP/TYPE):
        # `vllm:x` would become `vllm_x`. ':' is legal in OpenMetrics 1.0 names, and "allow-utf-8" writes such
        # (legacy-valid) names as they are; the content type then names no escaping.
        body = encoder.func(registry, **{**encoder.keywords, "escaping": "allow-utf-8"})
        return body, re.sub(r";\s*escaping=[^;]*", "", content_type)
    return encoder(registry), content_type


_HANDLES: dict[tuple[str, str], Any] = {}


async def gather(config: Any, local: list, timeout_s: float = 5.0) -> list:
    """`local` families (this ingress's) merged with every other ingress and router replica's latest (from the
    app's metrics hub) and every engine replica's, asked through Serve handles of this app. A replica that does
    not answer within `timeout_s` is left out of this scrape (logged); its series come back with the next one."""
    import asyncio

    from ray import serve

    app_name = serve.get_replica_context().app_name

    async def one(name: str) -> list:
        try:
            return await asyncio.wait_for(handle_of(name).metrics_families.remote(), timeout_s)
        except Exception as e:
            logger.warning("metrics of %s left out: %r", name, e)
            return []

    async def pushed() -> list[list]:
        from deploy.metrics_hub import HUB_NAME

        me = IngressMetrics.current
        try:
            return await asyncio.wait_for(handle_of(HUB_NAME).families.remote(
                exclude=None if me is None else f"ingress-{me.labels['replica']}"), timeout_s)
        except Exception as e:
            logger.warning("metrics of the other ingress and router replicas left out: %r", e)
            return []

    def handle_of(name: str) -> Any:
        # one handle per deployment for the process's life: a new handle per scrape would start a new request
        # router (and its long-poll) every scrape
        handle = _HANDLES.get((app_name, name))
        if handle is None:
            handle = _HANDLES[(app_name, name)] = serve.get_deployment_handle(name, app_name=app_name)
        return handle

    others, *engines = await asyncio.gather(pushed(), *(one(n) for n in config.engine_deployments()))
    return merge_families([local, *others, *engines])


def local_families() -> list:
    """This ingress process's families: its default registry (process_*, python_*) and its own metrics."""
    from prometheus_client import REGISTRY

    out = list(REGISTRY.collect())
    if IngressMetrics.current is not None:
        out += IngressMetrics.current.families()
    return out

