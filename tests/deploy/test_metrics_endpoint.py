"""Unit tests of the API port's /metrics (deploy/metrics_endpoint.py): names, merge, format negotiation, the
ingress's client-visible timing. No Ray: the sinks are prometheus_client registries only."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families as parse_text  # noqa: E402

from deploy.metrics import EngineMetrics, spec  # noqa: E402
from deploy.metrics_endpoint import (ArrivalStamp, IngressMetrics, RequestTiming, _ARRIVAL, exposition,  # noqa: E402
                                     merge_families, own_name, replica_sinks)
from workers.stats import EngineStats, RequestStats  # noqa: E402


def _request(rid: str, role: str = "unified", **kw) -> RequestStats:
    base = dict(request_id=rid, role=role, prompt_tokens=5, generation_tokens=3, finished_reason="length",
                arrival_time=10.0, first_scheduled_time=10.1, first_token_time=10.2, finished_time=10.4,
                token_times=[10.2, 10.3, 10.4])
    base.update(kw)
    return RequestStats(**base)


def _replica(role: str, index: int, requests: list[RequestStats]):
    sink, export = replica_sinks(role, ray=False)
    m = EngineMetrics("tiny", role, index, sink=sink)
    for r in requests:
        m.record_request(r)
    m.record_engine(EngineStats(role=role, num_pages_total=10, num_pages_free=10))
    return export


def _values(text: str, parse=parse_text) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parse(text) for s in f.samples}


def _total(values: dict[tuple, float], name: str, **labels) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and labels.items() <= dict(ls).items())


def test_vllm_names_and_each_request_once_per_side():
    assert own_name(spec("time_to_first_token_seconds"), "unified") == "vllm:time_to_first_token_seconds"
    assert own_name(spec("preemptions"), "decode") == "vllm:num_preemptions"
    assert own_name(spec("kv_transfer_seconds"), "prefill") == "m3serve_kv_transfer_seconds"
    # disaggregated: prompt side from prefill, output side from decode; the other copy under m3serve_
    assert own_name(spec("generation_tokens"), "prefill") == "m3serve_generation_tokens"
    assert own_name(spec("request_success"), "prefill") == "m3serve_request_success"
    assert own_name(spec("prompt_tokens"), "decode") == "m3serve_prompt_tokens"
    assert own_name(spec("time_to_first_token_seconds"), "decode") == "m3serve_time_to_first_token_seconds"
    assert own_name(spec("e2e_request_latency_seconds"), "decode") == "vllm:e2e_request_latency_seconds"
    assert own_name(spec("prompt_tokens"), "prefill") == "vllm:prompt_tokens"


def test_merge_concatenates_replicas_and_never_counts_a_series_twice():
    a = _replica("unified", 0, [_request("a1"), _request("a2")])
    b = _replica("unified", 1, [_request("b1", generation_tokens=4, token_times=[10.2, 10.3, 10.35, 10.4])])
    # the same replica's families gathered twice (two answers of one replica) must not add up
    merged = merge_families([a.families(), b.families(), a.families()])
    body, ctype = exposition(merged, None)
    assert ctype.startswith("text/plain; version=0.0.4")
    values = _values(body.decode())
    assert _total(values, "vllm:generation_tokens_total") == 3 + 3 + 4
    assert _total(values, "vllm:generation_tokens_total", replica="1") == 4
    assert _total(values, "vllm:request_success_total", finished_reason="length") == 3
    assert _total(values, "vllm:time_to_first_token_seconds_count") == 3
    assert _total(values, "vllm:num_requests_running") == 0
    # one HELP/TYPE per family, whichever replica it came from
    assert body.decode().count("# TYPE vllm:generation_tokens_total counter") == 1


def test_disaggregated_replicas_count_each_request_once_under_vllm_names():
    prefill = _replica("prefill", 0, [_request("r1", role="prefill", generation_tokens=1, token_times=[10.2],
                                               finished_reason="handoff")])
    decode = _replica("decode", 0, [_request("r1", role="decode")])
    values = _values(exposition(merge_families([prefill.families(), decode.families()]), None)[0].decode())
    assert _total(values, "vllm:prompt_tokens_total") == 5  # prefill's only
    assert _total(values, "vllm:generation_tokens_total") == 3  # decode's only
    assert _total(values, "vllm:request_success_total") == 1
    assert _total(values, "vllm:time_to_first_token_seconds_count") == 1
    assert _total(values, "m3serve_request_success_total", finished_reason="handoff") == 1


def test_openmetrics_when_the_accept_header_asks():
    merged = merge_families([_replica("unified", 0, [_request("a1")]).families()])
    body, ctype = exposition(merged, "application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert ctype.startswith("application/openmetrics-text")
    text = body.decode()
    assert text.endswith("# EOF\n")
    values = _values(text, parse_openmetrics)
    assert _total(values, "vllm:generation_tokens_total") == 3


def test_abort_is_counted_as_abort_not_success():
    export = _replica("unified", 0, [_request("a1"), _request("a2", finished_reason="abort")])
    values = _values(exposition(export.families(), None)[0].decode())
    assert _total(values, "vllm:request_success_total") == 1
    assert _total(values, "m3serve_request_abort_total") == 1
    assert _total(values, "vllm:e2e_request_latency_seconds_count") == 1


def test_ingress_timing_from_arrival_and_outcomes():
    metrics = IngressMetrics.install("tiny", "ing", ray=False)
    try:
        seen = []

        async def handler(scope, receive, send):
            seen.append(_ARRIVAL.get())
            t = RequestTiming()
            t.first_event()
            t.end("finished")
            t.end("abort")  # ignored: a request ends once
            RequestTiming().end("abort")

        asyncio.run(ArrivalStamp(handler)({"type": "http"}, None, None))
        assert seen[0] is not None and _ARRIVAL.get() is None
        values = _values(exposition(list(metrics.export.registry.collect()), None)[0].decode())
        assert _total(values, "m3serve_ingress_requests_total", outcome="finished") == 1
        assert _total(values, "m3serve_ingress_requests_total", outcome="abort") == 1
        assert _total(values, "m3serve_ingress_time_to_first_token_seconds_count", role="ingress") == 1
        assert _total(values, "m3serve_ingress_e2e_request_latency_seconds_count") == 1
    finally:
        IngressMetrics.current = None
