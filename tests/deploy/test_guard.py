"""The ingress's gate (deploy/guard.py, issue 22) through real Ray Serve: with a key set every path but /health
needs it (the docs and schema too) and a request without it is refused before its body is read; bodies over the
limit are 413 whether declared or streamed chunked; /v1/models shows no filesystem path. After each, the server
still serves. The middleware alone is also driven directly, as an ASGI app, where what it reads can be counted."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deploy.guard import Guard, GuardConfig, default_max_body_bytes
from tests.deploy.test_errors import assert_openai_error, still_serves

MAX_LEN = 512  # conftest TEST_CONFIG engine.max_model_len
LIMIT = default_max_body_bytes(MAX_LEN)


@pytest.mark.parametrize("method,path", [("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"),
                                         ("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize")])
def test_every_path_but_health_needs_the_key(serve_app, method, path):
    r = httpx.request(method, f"{serve_app.base_url}{path}", json={"prompt": "x"}, timeout=60)
    assert_openai_error(r, 401, code="invalid_api_key")
    r = httpx.request(method, f"{serve_app.base_url}{path}", json={"prompt": "x"}, timeout=60,
                      headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{serve_app.base_url}/health", timeout=60).status_code == 200


def test_an_unauthenticated_huge_body_is_refused_not_parsed(serve_app):
    body = json.dumps({"model": serve_app.model, "prompt": [7] * 3_000_000}).encode()  # ~9 MB
    r = httpx.post(f"{serve_app.base_url}/v1/completions", content=body, timeout=120,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 401, code="invalid_api_key")
    still_serves(serve_app)


def test_bodies_over_the_limit_are_413_declared_or_chunked(serve_app):
    body = json.dumps({"model": serve_app.model, "prompt": "a " * LIMIT}).encode()
    headers = {**serve_app.headers, "content-type": "application/json"}
    r = httpx.post(f"{serve_app.base_url}/v1/completions", content=body, headers=headers, timeout=120)
    assert_openai_error(r, 413, code="request_too_large")

    def chunks():  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    r = httpx.post(f"{serve_app.base_url}/v1/completions", content=chunks(), headers=headers, timeout=120)
    assert_openai_error(r, 413, code="request_too_large")
    still_serves(serve_app)


def test_models_show_no_filesystem_path(serve_app):
    for path in ("/v1/models", f"/v1/models/{serve_app.model}"):
        text = httpx.get(f"{serve_app.base_url}{path}", headers=serve_app.headers, timeout=60).text
        assert str(serve_app.model_dir) not in text and "/tmp" not in text and "/root" not in text, text


def _drive(guard: Guard, headers: dict[str, str], body: bytes, path: str = "/v1/completions", root: str = ""):
    """Run one request through `guard` in front of an app that reads the whole body -> (status, bytes the app
    read or None if it never ran)."""
    read: list[int] = []

    async def app(scope, receive, send):
        total = 0
        while True:
            m = await receive()
            total += len(m.get("body", b""))
            if not m.get("more_body"):
                break
        read.append(total)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[i:i + 1000] for i in range(0, len(body), 1000)] or [b""]
    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return queue.pop(0)

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": root, "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    guard.app = app
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], (read[0] if read else None)


def test_guard_refuses_before_reading_and_counts_undeclared_bodies():
    guard = Guard(None, lambda: GuardConfig(api_key="k", max_body_bytes=5000))
    assert _drive(guard, {}, b"x" * 100_000) == (401, None)  # never read
    assert _drive(guard, {"authorization": "Bearer k", "content-length": "100000"}, b"x" * 100_000) == (413, None)
    assert _drive(guard, {"authorization": "Bearer k"}, b"x" * 4000) == (200, 4000)  # chunked, replayed whole
    assert _drive(guard, {"authorization": "Bearer k", "content-length": "4000"}, b"x" * 4000) == (200, 4000)
    assert _drive(guard, {}, b"", path="/health") == (200, 0)
    assert _drive(guard, {}, b"", path="/app/health", root="/app") == (200, 0)
    assert _drive(guard, {"authorization": "Bearer k"}, b"x" * 6000) == (413, None)  # chunked past the limit
    with pytest.raises(Exception, match="larger than 5000"):  # more than declared: the app's handler answers
        _drive(guard, {"authorization": "Bearer k", "content-length": "10"}, b"x" * 6000)
    open_guard = Guard(None, lambda: GuardConfig(api_key=None, max_body_bytes=5000))
    assert _drive(open_guard, {}, b"x" * 10) == (200, 10)
