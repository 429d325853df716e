"""Two ingress replicas (issues 21 and 22), on an app of their own beside the shared one:

- `/metrics` on the API port, answered by either ingress, carries both ingresses' series (each labelled by its
  replica) and the router's, besides the engines': a real Prometheus scraping it reads the ingresses' request
  counts summed equal to what was sent, whichever replica answered each scrape (before, a scrape held only the
  answering ingress's series);
- `kill -9` of the ingress replica that carries long streams: the work it owned is aborted (the engine runs and
  holds nothing of it afterwards), the router's in-flight counts come back to zero within a bound (before, they
  stayed up for `HOLD_TTL_S`, an hour), and new requests succeed.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import threading
import time

import httpx
import pytest

from tests.deploy.promhelp import Prometheus

APP = "ingress2"
PROMPT = [random.Random(21).randrange(3, 384) for _ in range(24)]
LONG = 400  # tokens: streams still running when their ingress is killed (tens of seconds on 2 cores)
STREAMS = 4  # long streams in flight, spread by the proxy over both ingress replicas
RECOVER_BOUND_S = 60.0  # the dead ingress's work is aborted and every count is back to zero within this
N = 8  # requests of the metrics test


@pytest.fixture(scope="module")
def two_ingresses(serve_app):
    # no API key: Prometheus scrapes /metrics as it is
    base = serve_app.deploy_extra(APP, {**serve_app.config, "ingress_replicas": 2, "api_key": None})
    try:
        serve_app.wait_healthy_at(base)
        yield dataclasses.replace(serve_app, base_url=base, extra_apps=[], api_key="none")
    finally:
        serve_app.delete_extra(APP)


def _ingress_pids(tries: int = 10) -> dict[int, int]:
    """{pid: open engine streams} of both ingress replicas: calls made together, each answered after a while, so
    Serve spreads them (it sends a call to the replica with fewer in flight)."""
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", app_name=APP)
    seen: dict[int, int] = {}
    for _ in range(tries):
        for call in [handle.pid.remote(0.5) for _ in range(6)]:
            info = call.result(timeout_s=60)
            seen[info["pid"]] = info["live"]
        if len(seen) == 2:
            break
    return seen


def _complete(app, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{app.base_url}/v1/completions", headers=app.headers, timeout=120,
                      json={"model": app.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **extra})


def _long_stream(app, started: threading.Semaphore, stop: threading.Event, out: list) -> None:
    """A long stream read until `stop` (the client hangs up), its end, or its connection breaks; `out` gets how
    it ended."""
    chunks = 0
    try:
        with httpx.stream("POST", f"{app.base_url}/v1/completions", headers=app.headers, timeout=RECOVER_BOUND_S + 60,
                          json={"model": app.model, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if chunks == 2:
                        started.release()
                if stop.is_set():
                    out.append(("left", chunks))
                    return
        out.append(("ended", chunks))
    except httpx.HTTPError as e:  # the ingress carrying it died: the proxy cuts the connection
        out.append((type(e).__name__, chunks))
    finally:
        if chunks < 2:
            started.release()


def _counters(app) -> dict[str, int]:
    """How the engine replicas' requests ended so far, summed (finished, failed, rejected, aborted)."""
    out: dict[str, int] = {}
    for row in app.engine_stats():
        for k, v in (row["counters"] or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def _inflight(app) -> list[int]:
    return [row["inflight"] for row in app.engine_stats()]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus package is not installed")
def test_metrics_of_every_ingress_and_the_router(two_ingresses, tmp_path):
    """Runs first (the counts are absolute): the next test kills an ingress replica."""
    app = two_ingresses
    sel = f'{{model_name="{app.model}"}}'
    with Prometheus(tmp_path / "prom", [f"127.0.0.1:{app.port}"], metrics_path=f"/{APP}/metrics") as prom:
        assert prom.wait_healthy() == ["up"]
        tokens = 0
        for _ in range(N):
            r = _complete(app, max_tokens=4)
            assert r.status_code == 200, r.text
            tokens += r.json()["usage"]["completion_tokens"]
        # every scrape of the last 5 s (answered by either ingress replica) holds both replicas' series, and
        # their request counts sum to what was sent
        steady = "min_over_time((%s)[5s:1s])"
        replicas = f'count(count by (replica) (m3serve_ingress_requests_total{{role="ingress",model_name="{app.model}"}}))'
        prom.wait_until(steady % replicas, lambda v: v == 2, timeout_s=60)
        sent = f'sum(m3serve_ingress_requests_total{{model_name="{app.model}",outcome="finished"}})'
        prom.wait_until(steady % sent, lambda v: v == N, timeout_s=60)
        assert prom.scalar(f"max_over_time(({sent})[5s:1s])") == N
        # the router's series: what it placed on the engine replica, in flight back to 0; the engines' as before
        prom.wait_until(f'sum(m3serve_router_requests_total{{model_name="{app.model}",role="router"}})',
                        lambda v: v == N, timeout_s=30)
        prom.wait_until(f"sum(m3serve_router_inflight_requests{sel})", lambda v: v == 0, timeout_s=30)
        prom.wait_until(f"sum(vllm:generation_tokens_total{sel})", lambda v: v == tokens, timeout_s=30)


def test_kill_ingress_with_streams_in_flight(two_ingresses):
    app = two_ingresses
    assert _complete(app).status_code == 200
    app.wait_idle(timeout=30)
    before = _counters(app)
    started, stop = threading.Semaphore(0), threading.Event()
    ends: list = []
    threads = [threading.Thread(target=_long_stream, args=(app, started, stop, ends)) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    pids = _ingress_pids()
    assert len(pids) == 2 and sum(pids.values()) == STREAMS, pids
    assert sum(_inflight(app)) == STREAMS
    victim = max(pids, key=pids.get)  # the replica carrying the most streams
    os.kill(victim, signal.SIGKILL)  # its own process, as `kill -9` would
    killed_at = time.monotonic()
    time.sleep(1.0)
    stop.set()  # the survivor's clients hang up (aborts that work): what runs on after is the dead one's work
    for t in threads:
        t.join(timeout=120)
    assert len([e for e in ends if e[0] != "left"]) == pids[victim], ends  # the dead one's clients were cut
    # its work is aborted and the router lets go: no request runs or waits, every page is free, in-flight 0
    rows = app.wait_idle(timeout=max(1.0, RECOVER_BOUND_S - (time.monotonic() - killed_at)))
    assert all(r["inflight"] == 0 and r["stats"]["num_pages_free"] == r["stats"]["num_pages_total"]
               for r in rows), rows
    after = _counters(app)
    # every stream was aborted, none ran on to its max_tokens (a request the dead ingress owned used to)
    assert after.get("aborted", 0) - before.get("aborted", 0) == STREAMS, (before, after, ends)
    assert after.get("finished", 0) == before.get("finished", 0), (before, after, ends)
    # and the app goes on serving (the proxy sends to the survivor, then to the restarted replica)
    for _ in range(4):
        r = _complete(app)
        assert r.status_code == 200, r.text
