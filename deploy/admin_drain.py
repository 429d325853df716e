"""`POST /admin/drain`: drain the ingress replica that answers, for Kubernetes' preStop hook (deploy/drain_hook.py).

`m3serve serve` drains every ingress replica on SIGTERM through `Ingress.drain` (deploy/serve_cmd.py). On
Kubernetes nothing signals the app: KubeRay stops pods, and a stopping worker pod's preStop hook is the only place
to act before its processes die. The hook calls this route on its own pod's ingress replica(s): on each one's own
direct-ingress port behind HAProxy, else through the pod's Serve proxy (which prefers replicas on its node). The
drain is the CLI's: new requests on that replica get 503 `shutting_down` + Retry-After, its readiness goes 503 (so
Kubernetes takes the pod out of the Service), requests in flight get the grace period, the rest end with an error
event and `[DONE]`; the answer comes when the drain is over.

The request may name the node it means (`node_ip`, the pod's IP): a replica on another node answers 409
`other_node` and does NOT drain, so a proxy that sent the call elsewhere can never take a healthy pod's ingress
out of service; the hook then tries again (or there is no ingress on its pod, and nothing to drain).
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploy.errors import ApiError

ROUTE = "/admin/drain"


class DrainRequest(BaseModel):
    """The body (all optional; an empty body drains with the configured grace period)."""

    model_config = ConfigDict(extra="forbid")
    grace_s: float | None = Field(default=None, ge=0, le=3600, allow_inf_nan=False)
    node_ip: str | None = Field(default=None, max_length=255)


def node_ip() -> str:
    """The IP of the Ray node this replica runs on (on KubeRay: the pod's IP)."""
    import ray

    return ray.util.get_node_ip_address()


async def parse(request: Request) -> DrainRequest:
    raw = await request.body()
    if not raw.strip():
        return DrainRequest()
    try:
        data = json.loads(raw)
    except ValueError:
        raise ApiError(400, "body: not valid JSON", code="invalid_value") from None
    try:
        return DrainRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value") from None

async def handle(request: Request, drain: Callable[[float], Awaitable[dict]], default_grace_s: float,
                 here: Callable[[], str] = node_ip) -> JSONResponse:
    """The route: check the node, then drain (`Ingress.drain`, shared with the CLI) and answer its counts."""
    body = await parse(request)
    mine = here()
    if body.node_ip is not None and body.node_ip != mine:
        raise ApiError(409, f"node_ip: this ingress replica runs on {mine}, not {body.node_ip}; not drained",
                       param="node_ip", code="other_node")
    grace = default_grace_s if body.grace_s is None else body.grace_s
    counts = await drain(grace)
    return JSONResponse({**counts, "node_ip": mine, "grace_s": grace})
