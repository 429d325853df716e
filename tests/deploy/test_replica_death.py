"""`kill -9` of each replica role mid-stream (issue 22), in the disaggregated and the unified layout, each on an app of
its own beside the shared ones (so their engines are never touched): the stream in flight ends within a bound, with
its tokens or with a retryable 503 error event and then `[DONE]`; `/health` goes not-ready while Serve restarts the
replica and ready again after; the restarted replica is re-wired (KV pairs re-opened at the next generation) without
anyone asking; new requests then get the same greedy tokens as before the kill; no request runs or waits and no KV
page is held anywhere afterwards. (Before the re-wiring, every request after a decode replica's restart was
`400 group: no pairs to 'prefill-0#...'` for good, while `/health` said 200.)
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time

import httpx

from tests.deploy.pdapp import PD_CONFIG

PROMPT = [random.Random(22).randrange(3, 384) for _ in range(40)]
LONG = 400  # tokens: a stream that is still running when its replica is killed (tens of seconds on 2 cores)
END_BOUND_S = 60.0  # a stream whose replica died ends (error event + [DONE]) within this
BACK_BOUND_S = 240.0  # Serve restarts the replica and its engine loads again (2 shared cores)


def _handle(app: str, name: str):
    from ray import serve

    return serve.get_deployment_handle(name, app_name=app)


def _pid(app: str, name: str) -> int:
    return _handle(app, name).pid.remote().result(timeout_s=120)


def _complete(app_url: str, headers: dict, model: str, max_tokens: int = 8, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{app_url}/v1/completions", headers=headers, timeout=timeout,
                      json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True})


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _stream_and_kill(app_url: str, headers: dict, model: str, kill) -> dict:
    """Stream a long completion; after its second chunk, `kill()`; read on to the end. Returns the SSE data items
    (parsed JSON, or the string "[DONE]"), whether the kill happened, and seconds from the kill to the end."""
    items: list = []
    killed_at = None
    with httpx.stream("POST", f"{app_url}/v1/completions", headers=headers, timeout=END_BOUND_S + 60,
                      json={"model": model, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            items.append(data if data == "[DONE]" else json.loads(data))
            if killed_at is None and len(items) == 2:
                kill()
                killed_at = time.monotonic()
    return {"items": items, "killed": killed_at is not None,
            "after_kill_s": None if killed_at is None else time.monotonic() - killed_at}


def _assert_clean_end(run: dict, *, must_fail: bool) -> None:
    """The stream ended with [DONE] after either its last token (finish_reason set) or one retryable 503 error."""
    items = run["items"]
    assert run["killed"], f"the stream ended before the kill: {items[-3:]}"
    assert items[-1] == "[DONE]", items[-3:]
    last = items[-2]
    if "error" in last:
        err = last["error"]
        assert err["code"] in ("engine_unavailable", "kv_transfer_failed", "kv_unwired"), err
        assert err["type"] != "internal_error" and "internal" not in str(err["code"]), err
    else:
        assert not must_fail, f"the stream went on although its replica died: {items[-3:]}"
        assert last["choices"][0]["finish_reason"] == "length", last
    assert run["after_kill_s"] < END_BOUND_S


def _kill(app: str, name: str) -> int:
    pid = _pid(app, name)
    os.kill(pid, signal.SIGKILL)  # the replica's own process, as `kill -9` would
    return pid


def _health_down_then_up(app_url: str) -> list:
    """/health is 503 at some point after a kill (while the replica restarts), then 200 again."""
    seen: list = []
    deadline = time.monotonic() + BACK_BOUND_S
    while time.monotonic() < deadline:
        try:
            seen.append(httpx.get(f"{app_url}/health", timeout=30).status_code)
        except httpx.HTTPError as e:
            seen.append(type(e).__name__)
        if 503 in seen and seen[-1] == 200:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"/health did not go 503 then 200 within {BACK_BOUND_S} s: {seen[-20:]}")


def _serves_again(app_url: str, headers: dict, model: str, want: list[int]) -> None:
    """Once /health is ready, requests succeed: 4 at once, each with the greedy tokens from before the kill."""
    results: list = [None] * 4

    def one(i: int) -> None:
        results[i] = _complete(app_url, headers, model)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [_tokens(r) for r in results] == [want] * 4, [r.text[:300] for r in results]


def _assert_idle(serve_app, app_url: str) -> None:
    app = dataclasses.replace(serve_app, base_url=app_url, extra_apps=[])
    rows = app.wait_idle(timeout=60)  # no request running or waiting, every page free, router counts at zero
    assert all(r["stats"]["num_pages_free"] == r["stats"]["num_pages_total"] for r in rows), rows


def test_kill_each_disaggregated_replica_mid_stream(serve_app):
    app_name = "pdkill"
    base = serve_app.deploy_extra(app_name, {**PD_CONFIG, "api_key": serve_app.api_key})
    h, model = serve_app.headers, serve_app.model
    try:
        serve_app.wait_healthy_at(base)
        want = _tokens(_complete(base, h, model))
        pairs = _handle(app_name, "Router").pairs.remote().result()
        assert pairs == {"prefill-0->decode-0": 0}

        # the decode replica dies mid-stream: the stream it carried ends with a retryable 503 event and [DONE]
        run = _stream_and_kill(base, h, model, lambda: _kill(app_name, "EngineServer-decode-0"))
        _assert_clean_end(run, must_fail=True)
        _health_down_then_up(base)
        _serves_again(base, h, model, want)  # was: 400 "group: no pairs to 'prefill-0#...'" for good
        after = _handle(app_name, "Router").pairs.remote().result()
        assert after["prefill-0->decode-0"] > pairs["prefill-0->decode-0"], after  # re-wired, no one asked
        _assert_idle(serve_app, base)

        # the prefill replica dies while a stream decodes (that stream needs it no more) and a request arrives
        answers: list = []
        run = _stream_and_kill(base, h, model, lambda: (_kill(app_name, "EngineServer-prefill-0"),
                                                         answers.append(_complete(base, h, model, timeout=300))))
        _assert_clean_end(run, must_fail=False)
        # the request sent right after the kill: its tokens, or a retryable refusal (never a 400 or a 500)
        assert answers[0].status_code == 200 or answers[0].status_code == 503, answers[0].text
        _health_down_then_up(base)
        _serves_again(base, h, model, want)
        assert _handle(app_name, "Router").pairs.remote().result()["prefill-0->decode-0"] \
            > after["prefill-0->decode-0"]
        _assert_idle(serve_app, base)

        # the router dies mid-stream: the stream comes straight from the decode replica and goes on; a new router
        # opens pairs of its own
        _kill_router_mid_stream(serve_app, app_name, base, want)
    finally:
        serve_app.delete_extra(app_name)


def _kill_router_mid_stream(serve_app, app_name: str, base: str, want) -> None:
    """The router dies mid-stream: the stream comes straight from its engine replica and goes on; a new router
    takes over (opening KV pairs of its own where there are any) and the app serves the same tokens again."""
    h, model = serve_app.headers, serve_app.model
    run = _stream_and_kill(base, h, model, lambda: _kill(app_name, "Router"))
    _assert_clean_end(run, must_fail=False)
    serve_app.wait_healthy_at(base)
    _serves_again(base, h, model, want)
    _assert_idle(serve_app, base)


def test_kill_each_unified_replica_mid_stream(serve_app):
    app_name = "ukill"
    base = serve_app.deploy_extra(app_name, dict(serve_app.config))
    h, model = serve_app.headers, serve_app.model
    try:
        serve_app.wait_healthy_at(base)
        want = _tokens(_complete(base, h, model))

        run = _stream_and_kill(base, h, model, lambda: _kill(app_name, "EngineServer-unified-0"))
        _assert_clean_end(run, must_fail=True)  # was a 500 internal_error event
        _health_down_then_up(base)
        _serves_again(base, h, model, want)
        _assert_idle(serve_app, base)

        _kill_router_mid_stream(serve_app, app_name, base, want)
    finally:
        serve_app.delete_extra(app_name)
