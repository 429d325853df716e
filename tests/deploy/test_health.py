"""/health reflects the engines now (issue 22): kill -9 the engine replica of an app mid-life, and /health goes
503 while Serve restarts it and 200 once it is back, and the app then serves again. (The first success used to be
cached for good: 200 while the engine was dead or loading.) Runs as its own app of the shared Serve instance, so
the other tests' engine is never touched."""
from __future__ import annotations

import time

import httpx

APP = "healthkill"


def _engine_pid(app: str) -> int:
    from ray import serve

    return serve.get_deployment_handle("EngineServer-unified-0", app_name=app).pid.remote().result(timeout_s=120)


def test_health_follows_a_killed_engine_down_and_back_up(serve_app, serve_helpers):
    import os
    import signal

    base = serve_app.deploy_extra(APP, dict(serve_app.config))
    try:
        serve_helpers.wait_healthy(base)
        pid = _engine_pid(APP)
        os.kill(pid, signal.SIGKILL)  # the replica's own process, as `kill -9` would
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # not ready at some point while Serve replaces it
            try:
                seen.append(httpx.get(f"{base}/health", timeout=15).status_code)
            except httpx.HTTPError:
                seen.append(None)
            if 503 in seen:
                break
            time.sleep(0.2)
        assert 503 in seen, f"/health never said not-ready after the engine died: {seen[-10:]}"
        serve_helpers.wait_healthy(base)
        assert _engine_pid(APP) != pid  # a new replica answers
        r = httpx.post(f"{base}/v1/completions", headers=serve_app.headers, timeout=120,
                       json={"model": serve_app.model, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        serve_app.delete_extra(APP)
