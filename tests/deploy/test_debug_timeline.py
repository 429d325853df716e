"""EngineServer.debug_timeline through a Serve handle on the session's running app: the steps that served a
streamed request (wall clock, its token counts) and the chunks the replica sent for it (what
benchmarks/bench_serving_pd.py reads after each phase)."""
from __future__ import annotations

import json
import time

import httpx

APP_NAME = "m3"  # the session app (tests/deploy/conftest.py)


def test_debug_timeline_has_the_steps_and_chunks_of_a_streamed_request(serve_app):
    from ray import serve

    since = time.time()
    body = {"model": serve_app.model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "temperature": 0,
            "stream": True, "ignore_eos": True}
    r = httpx.post(f"{serve_app.base_url}/v1/completions", json=body, headers=serve_app.headers, timeout=60)
    assert r.status_code == 200
    first = json.loads(r.text.split("data:", 2)[1].split("\n", 1)[0])
    rid = f"{first['id']}-0"  # the ingress's engine request id for prompt 0

    engine = serve.get_deployment_handle("EngineServer-unified-0", app_name=APP_NAME)
    tl = engine.debug_timeline.remote(since).result(timeout_s=30)
    assert tl["role"] == "unified" and tl["pid"] > 0
    steps = [dict(zip(tl["step_fields"], s)) for s in tl["steps"]]
    mine = [s for s in steps if any(r_ == rid for r_, _ in s["tokens"])]
    assert [n for s in mine for r_, n in s["tokens"] if r_ == rid] == [1, 2, 3, 4, 5]
    assert all(since <= s["start"] <= s["end"] <= tl["now"] for s in mine)
    assert mine[0]["prefill_tokens"] >= 5
    chunks = [m for m in tl["serve_marks"] if m[1] == rid and m[2] == "chunk"]
    assert sum(m[3] for m in chunks) == 5
    # each chunk left the replica after the step that made its token
    assert chunks[0][0] >= mine[0]["end"] and chunks[-1][0] >= mine[-1]["end"]
    # the replica's garbage collections since then (deploy/gc_pauses.py): (time, seconds, generation, collected)
    assert isinstance(tl["gc"], list)
    assert all(len(p) == 4 and since <= p[0] <= tl["now"] and p[1] >= 0 and p[2] in (0, 1, 2) for p in tl["gc"])
    # the metrics reporter's ticks since then (deploy/metrics.py EngineReporter: every 0.5 s while it runs)
    deadline = time.time() + 10
    while not tl["metrics_ticks"] and time.time() < deadline:
        time.sleep(0.6)
        tl = engine.debug_timeline.remote(since).result(timeout_s=30)
    assert tl["metrics_ticks"], "no metrics tick recorded in 10 s"
    assert all(len(t) == 3 and since <= t[0] <= tl["now"] and t[1] >= 0 and t[2] >= 0 for t in tl["metrics_ticks"])
