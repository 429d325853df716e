"""The ingress's first gate, in front of every route: the API key and the body size, before a byte is parsed.

FastAPI reads and validates a request body before a route's own code runs, so a key checked inside the route came
after the parse: a 50 MB id list without a key took 20 s to be told 401, and any body of any size was read whole
(a 50 MB prompt held the ingress for 99 s; Serve then replaced it). This is a plain ASGI middleware (not
`BaseHTTPMiddleware`, which would buffer the body itself):
- With a key set, every path but the probes (`/health`, `/health/ready`, `/health/live`) needs `Authorization: Bearer <key>` (the docs and the OpenAPI schema
  too): 401 `invalid_api_key` at once, the body never read.
- A declared `Content-Length` over the limit is 413 `request_too_large` at once. A body without one (chunked) is
  read here up to the limit (at most that much is held) and replayed to the app, or answered with the same 413
  as soon as it passes the limit: an error raised from inside FastAPI's body read came out as a 400.
Errors are OpenAI's error JSON, as every other error of the API.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

OPEN_PATHS = ("/health", "/health/ready", "/health/live")  # probes carry no key (Kubernetes, load balancers)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    api_key: str | None  # None: no auth
    max_body_bytes: int


def default_max_body_bytes(max_model_len: int) -> int:
    """Room for a whole context as a JSON id list (~7 bytes an id) or as text (a few bytes a token), with margin:
    16 bytes per token of max_model_len + 1 MiB (the tiny model: ~1 MiB; a 1M-token M3: ~17 MiB)."""
    return 16 * max_model_len + (1 << 20)


class BodyTooLarge(Exception):
    """Raised from `receive` when a body without a Content-Length passes the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


def error_body(status: int, message: str, code: str) -> bytes:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class Guard:
    """ASGI middleware; `config` is read per request (the ingress sets it once its replica has its ServeConfig)."""

    def __init__(self, app: Callable, config_of: Callable[[], GuardConfig | None]) -> None:
        self.app = app
        self.config_of = config_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        config = self.config_of() if scope["type"] == "http" else None
        if config is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if config.api_key is not None and _route(scope) not in OPEN_PATHS and not _key_ok(headers, config.api_key):
            return await _answer(send, 401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                 "invalid_api_key")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            return await _answer(send, 413, f"the request body ({declared} bytes) is larger than the server's "
                                            f"limit of {config.max_body_bytes} bytes", "request_too_large")
        if declared is None and scope.get("method", "GET") not in ("GET", "HEAD"):
            messages = await _read_up_to(receive, config.max_body_bytes)
            if messages is None:
                return await _answer(send, 413, f"the request body is larger than the server's limit of "
                                                f"{config.max_body_bytes} bytes", "request_too_large")
            receive = _replay(messages, receive)
        return await self.app(scope, _counting(receive, config.max_body_bytes), send)


def _route(scope: Scope) -> str:
    """The path below the app's mount point (a Serve route prefix arrives as root_path: /scripted/health)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _key_ok(headers: dict[str, str], key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def _read_up_to(receive: Receive, limit: int) -> list[dict] | None:
    """The body's messages, or None once they pass `limit` bytes (the rest is not read)."""
    messages, seen = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message.get("type") != "http.request":
            return messages  # a disconnect: the app sees it
        seen += len(message.get("body", b""))
        if seen > limit:
            return None
        if not message.get("more_body"):
            return messages


def _replay(messages: list[dict], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


def _counting(receive: Receive, limit: int) -> Receive:
    """Past the declared length's check, a client that sends more than it declared still stops at the limit."""
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return wrapped


async def _answer(send: Send, status: int, message: str, code: str) -> None:
    body = error_body(status, message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["BodyTooLarge", "Guard", "GuardConfig", "OPEN_PATHS", "default_max_body_bytes", "error_body"]
