"""`POST /admin/drain` and the Kubernetes preStop hook that calls it (deploy/admin_drain.py, deploy/drain_hook.py),
through real Serve on loopback, on an app of its own (a drained ingress refuses for good, so the app is deleted
after): a call that names another node drains nothing (409 `other_node`); no key is a 401 and a bad field a 400
naming it; then the hook, as the chart's preStop runs it, drains the ingress: readiness 503 `shutting_down`, new
requests 503 + `Retry-After`, liveness 200; the stream that can finish within the grace period finishes, the one that
cannot ends with an error event and `[DONE]`; the hook returns once the drain is over; the engines end idle."""
from __future__ import annotations

import dataclasses
import threading

import httpx
import pytest

from deploy import drain_hook
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


def test_admin_drain_through_the_prestop_hook(own_app, monkeypatch, capsys):
    import ray

    app = own_app
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
    assert "drained 1 ingress replica(s)" in said and "1 request(s) finished, 1 ended" in said, said
    assert_short_finished_long_ended(short, long)
    # the drained request was aborted on its engine: nothing runs, waits or holds a page
    app.wait_idle(timeout=60)
