"""`POST /admin/drain` and the Kubernetes preStop hook that calls it (deploy/admin_drain.py, deploy/drain_hook.py).

Through real Serve's proxy on loopback, on an app of its own (a drained ingress refuses for good, so the app is
deleted after): a call that names another node drains nothing (409 `other_node`); no key is a 401 and a bad field a
400 naming it; then the hook, as the chart's preStop runs it, finds no direct-ingress replica and drains the ingress
through the proxy: readiness 503 `shutting_down`, new requests 503 + `Retry-After`, liveness 200; the stream that
can finish within the grace period finishes, the one that cannot ends with an error event and `[DONE]`; the hook
returns once the drain is over; the engines end idle.

Behind HAProxy (`m3serve serve --http-proxy haproxy`, two Ingress replicas, a real HAProxy): the hook finds both
replicas' own ports (the ones Ray's HAProxy config lists) and drains each directly, while the front it is given
answers every call as a cluster-wide HAProxy would when they all land on other nodes' replicas (409), so the old
way (calls through the front) would drain nothing. The discovery itself on stand-in listeners: only replicas of the
hook's route prefix are called; a listener of another app or no replica at all is left alone.

The hook scans a port window of its own in every test (`RAY_SERVE_DIRECT_INGRESS_*_HTTP_PORT`, which the HAProxy
server's Ray reads too): other Ray clusters on this machine may hold direct-ingress replicas in Ray's default range.
"""
from __future__ import annotations

import dataclasses
import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from deploy import drain_hook
from tests.deploy.procs import listener
from tests.deploy.test_drain import _Reader, assert_short_finished_long_ended

APP = "drainapp"
GRACE_S = 3  # the short stream (24 tokens) finishes well within it, the long one (4k tokens) cannot
MAX_MODEL_LEN = 4096
PROMPT = [21, 22, 23, 24, 25, 26, 27, 28]


@pytest.fixture
def own_app(serve_app):
    config = {**serve_app.config, "engine": {**serve_app.config["engine"], "max_model_len": MAX_MODEL_LEN}}
    base = serve_app.deploy_extra(APP, config)
    try:
        serve_app.wait_healthy_at(base)
        yield dataclasses.replace(serve_app, base_url=base, extra_apps=[])
    finally:
        serve_app.delete_extra(APP)


def _post(app, body: dict | None, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{app.base_url}/admin/drain", headers=app.headers if headers is None else headers,
                      json=body, timeout=60)


def _free_window(n: int, low: int = 30600, high: int = 30990) -> tuple[int, int]:
    """`n` consecutive ports free on loopback and every interface, at the top of Ray's direct-ingress range (Ray
    hands its ports out from the bottom; the kernel's ephemeral range starts above it)."""
    starts = list(range(low, high - n + 1, n))
    random.shuffle(starts)
    for start in starts:
        held = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
            return start, start + n - 1
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"no {n} consecutive free ports in {low}-{high}")


def _scan_window(monkeypatch, window: tuple[int, int]) -> None:
    for name, port in zip(drain_hook.PORT_RANGE_ENV, window):
        monkeypatch.setenv(name, str(port))


def test_admin_drain_through_the_prestop_hook(own_app, monkeypatch, capsys):
    import ray

    app = own_app
    _scan_window(monkeypatch, _free_window(4))  # nothing listens there: the hook goes through Serve's proxy
    # refusals first: none of them drains anything
    other = _post(app, {"node_ip": "10.255.255.1"})
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "other_node" and other.json()["error"]["param"] == "node_ip"
    assert _post(app, {}, headers={}).status_code == 401
    bad = _post(app, {"grace_s": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grace_s", bad.text
    assert drain_hook.drain(app.base_url, 1.0, 2, app.api_key, "10.255.255.1") == {}  # the hook on another node
    assert httpx.get(f"{app.base_url}/health", timeout=30).status_code == 200

    common = {"model": app.model, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    # the whole context (thousands of tokens: far longer than GRACE_S), and a few tokens (well within it)
    long = _Reader(app.base_url, {**common, "max_tokens": MAX_MODEL_LEN - len(PROMPT)}, app.headers)
    short = _Reader(app.base_url, {**common, "max_tokens": 24}, app.headers)
    long.start()
    assert long.first.wait(120) and long.error is None, long.error
    short.start()
    assert short.first.wait(120) and short.error is None, short.error

    # the chart's preStop: `python -m deploy.drain_hook --port P --prefix /app --grace G --calls N`
    monkeypatch.setenv(drain_hook.API_KEY_ENV, app.api_key)
    monkeypatch.setenv(drain_hook.POD_IP_ENV, ray.util.get_node_ip_address())
    hook = threading.Thread(target=drain_hook.main, daemon=True,
                            args=(["--port", str(app.port), "--prefix", f"/{APP}", "--grace", str(GRACE_S),
                                   "--calls", "2"],))
    hook.start()
    deadline_s = 30
    for _ in range(deadline_s * 10):
        ready = httpx.get(f"{app.base_url}/health/ready", timeout=30)
        if ready.status_code == 503:
            break
        threading.Event().wait(0.1)
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down", ready.text
    live = httpx.get(f"{app.base_url}/health/live", timeout=30)
    assert live.status_code == 200 and live.json()["draining"] is True
    refused = httpx.post(f"{app.base_url}/v1/completions", headers=app.headers, timeout=30,
                         json={**common, "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    assert refused.json()["error"]["code"] == "shutting_down"

    hook.join(GRACE_S + 60)
    assert not hook.is_alive(), "the hook did not return after the drain"
    said = capsys.readouterr().err  # both streams were in flight when the drain began: one finished, one was ended
    assert "drained 1 ingress replica(s) on this pod (through port" in said, said
    assert "1 request(s) finished, 1 ended" in said, said
    assert_short_finished_long_ended(short, long)
    # the drained request was aborted on its engine: nothing runs, waits or holds a page
    app.wait_idle(timeout=60)


class _StandIn:
    """A local HTTP listener answering `GET /-/routes` with `routes` (None: 404, as a service that is no Serve
    replica) and `POST .../admin/drain` with `drain_status` and a replica's answer; it records every call."""

    def __init__(self, port: int, routes: dict | None, drain_status: int = 200, name: str = "r") -> None:
        self.calls: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                outer.calls.append(("GET", self.path, {}))
                if self.path == "/-/routes" and routes is not None:
                    self._answer(200, routes)
                else:
                    self._answer(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.calls.append(("POST", self.path, body))
                if drain_status == 200:
                    self._answer(200, {"open": 0, "ended": 0, "replica": name, "node_ip": body.get("node_ip")})
                else:
                    self._answer(drain_status, {"error": {"code": "other_node", "message": "elsewhere"}})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def posts(self) -> list[tuple[str, dict]]:
        return [(path, body) for method, path, body in self.calls if method == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_hook_calls_only_this_apps_direct_ingress_replicas(monkeypatch, capsys):
    """Discovery on stand-ins for what may listen in the direct-ingress range: two replicas of the hook's app, a
    replica of another app, an HTTP service that is no replica, a listener that speaks no HTTP. The hook drains the
    two (one call each, naming the pod's IP, with the grace period and the key) and never calls the front; with no
    replica of its app in the range it goes through the front instead."""
    low, high = _free_window(6)
    _scan_window(monkeypatch, (low, high))
    monkeypatch.setenv(drain_hook.POD_IP_ENV, "127.0.0.1")
    monkeypatch.setenv(drain_hook.API_KEY_ENV, "k")
    ours = [_StandIn(low, {"/app": "app"}, name="a"), _StandIn(low + 2, {"/app": "app"}, name="b")]
    others = [_StandIn(low + 1, {"/other": "other"}), _StandIn(low + 3, None)]
    raw = socket.create_server(("127.0.0.1", low + 4))  # accepts, then closes without a word

    def hang_up():
        while True:
            try:
                raw.accept()[0].close()
            except OSError:  # closed at the end of the test
                return

    threading.Thread(target=hang_up, daemon=True).start()
    front = _StandIn(_free_window(1, 30400, 30590)[0], {"/app": "app"}, drain_status=409)  # HAProxy, other nodes
    try:
        assert drain_hook.find_replicas("/app/", ["127.0.0.1"]) == ("127.0.0.1", [low, low + 2])
        assert drain_hook.main(["--port", str(front.server.server_port), "--prefix", "/app", "--grace", "7"]) == 0
        said = capsys.readouterr().err
        assert "drained 2 ingress replica(s) on this pod (direct)" in said, said
        for r in ours:
            assert r.posts() == [("/app/admin/drain", {"node_ip": "127.0.0.1", "grace_s": 7.0})]
        assert not any(r.posts() for r in others) and front.calls == []

        # no replica of this prefix in the range: the front gets the calls (here all refused: nothing drained)
        monkeypatch.setattr(drain_hook, "ROUNDS", 1)
        assert drain_hook.main(["--port", str(front.server.server_port), "--prefix", "/else", "--calls", "3"]) == 0
        said = capsys.readouterr().err
        assert f"no direct-ingress replica of /else in ports {low}-{high}" in said, said
        assert "drained 0 ingress replica(s) on this pod (through port" in said, said
        assert len(front.posts()) == 3 and all(path == "/else/admin/drain" for path, _ in front.posts())
        assert [len(r.posts()) for r in ours] == [1, 1]

        # whatever goes wrong, the pod's termination goes on
        monkeypatch.setattr(drain_hook, "find_replicas", lambda *a: 1 / 0)
        assert drain_hook.main(["--prefix", "/app"]) == 0
        assert "failed: ZeroDivisionError" in capsys.readouterr().err
    finally:
        for r in [*ours, *others, front]:
            r.close()
        raw.close()


@pytest.fixture
def haproxy_server(tmp_path, monkeypatch):
    """`m3serve serve --http-proxy haproxy` with two Ingress replicas whose direct-ingress ports Ray takes from a
    window of this test's own (its Ray processes inherit the variables)."""
    from tests.deploy.test_metrics_api_e2e import _Server

    window = _free_window(8)
    _scan_window(monkeypatch, window)
    config = tmp_path / "two-ingress.yaml"
    config.write_text("ingress_replicas: 2\n")
    server = _Server(tmp_path, "--http-proxy", "haproxy", "--config", str(config), "--drain-grace", "1")
    try:
        server.wait_ready()
        yield server, window
    finally:
        server.stop()


def test_the_hook_drains_this_pods_replicas_behind_haproxy(haproxy_server, monkeypatch, capsys):
    server, (low, high) = haproxy_server
    haproxy, name = listener(server.port)
    assert name == "haproxy", name
    # the hook finds both replicas' own ports: those Ray's HAProxy config sends to, none of them HAProxy's
    cmdline = Path(f"/proc/{haproxy}/cmdline").read_bytes().split(b"\0")
    cfg = Path(next(a for a in cmdline if a.endswith(b"haproxy.cfg")).decode()).read_text()
    servers = sorted(int(line.split()[2].rsplit(":", 1)[1]) for line in cfg.splitlines()
                     if line.strip().startswith("server ") and " check" in line and "backup" not in line)
    host, ports = drain_hook.find_replicas("/", ["127.0.0.1"])
    assert len(ports) == 2 and ports == servers and all(low <= p <= high for p in ports), (ports, cfg)
    assert all(listener(p)[0] != haproxy for p in ports)
    # named from another node, each replica refuses and nothing drains
    assert drain_hook.drain_direct(host, ports, "/", 1.0, None, "10.255.255.1") == {}
    assert httpx.get(f"{server.base}/health/ready", timeout=30).status_code == 200

    # the chart's preStop, with a front that refuses every call as a cluster-wide HAProxy does when all of them
    # land on other nodes' replicas: only the direct calls can drain this pod's replicas
    front = _StandIn(_free_window(1, 30400, 30590)[0], {"/": "m3serve"}, drain_status=409)
    monkeypatch.setenv(drain_hook.POD_IP_ENV, "127.0.0.1")
    try:
        assert drain_hook.main(["--port", str(front.server.server_port), "--prefix", "/", "--grace", "1",
                                "--calls", "4"]) == 0
    finally:
        front.close()
    said = capsys.readouterr().err
    assert "drained 2 ingress replica(s) on this pod (direct)" in said, said
    assert front.calls == []
    for port in ports:  # each replica, asked on its own port, is draining
        ready = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down", ready.text
    ready = httpx.get(f"{server.base}/health/ready", timeout=30)  # so HAProxy, whichever it picks
    assert ready.status_code == 503, ready.text
    live = httpx.get(f"{server.base}/health/live", timeout=30)
    assert live.status_code == 200 and live.json()["draining"] is True
