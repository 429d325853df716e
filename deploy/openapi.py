"""The OpenAPI schema the server serves at /openapi.json, made true to what it sends (issue 20).

FastAPI's generated schema documents a 422 for every body it validates, JSON for every 200, and no errors; this
server answers invalid requests with 400 in OpenAI's error shape (`ErrorResponse`), streams chat and completions
as `text/event-stream` when `stream` is true, serves Prometheus text at /metrics, and answers with the statuses
below. `server_openapi(app)` takes FastAPI's schema and rewrites those parts; `install(app)` makes it the app's.
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI

from deploy.protocol import (
    ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse, ErrorResponse, ModelCard,
    ModelList,
)

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_DESCRIPTIONS = {
    400: "Invalid request (the error's `param` names the field)",
    401: "Missing or wrong API key",
    413: "Request body over the server's limit (`max_request_bytes`)",
    404: "Unknown model",
    409: "Another node's ingress replica answered (`node_ip`); nothing was drained",
    429: "Too many requests waiting (Retry-After)",
    500: "Internal error",
    503: "Not ready, or the engines cannot take the request now (Retry-After)",
}
_AUTH = (401,)
_GENERATE = (400, 401, 404, 413, 429, 500, 503)
# (path, method) -> the error statuses it answers (besides 200), and its 200 body: a model per media type.
_ROUTES: dict[tuple[str, str], tuple[tuple[int, ...], dict[str, Any]]] = {
    ("/v1/completions", "post"): (_GENERATE, {"application/json": CompletionResponse,
                                             "text/event-stream": CompletionChunk}),
    ("/v1/chat/completions", "post"): (_GENERATE, {"application/json": ChatCompletionResponse,
                                                  "text/event-stream": ChatCompletionChunk}),
    ("/v1/models", "get"): (_AUTH, {"application/json": ModelList}),
    ("/v1/models/{model_id}", "get"): ((401, 404), {"application/json": ModelCard}),
    ("/tokenize", "post"): ((400, 401, 404, 413, 503), {}),
    ("/detokenize", "post"): ((400, 401, 404, 413, 503), {}),
    ("/health", "get"): ((503,), {}),
    ("/health", "head"): ((503,), {}),
    ("/metrics", "get"): (_AUTH, {"text/plain": None}),
    ("/admin/stats", "get"): (_AUTH, {}),
    ("/admin/drain", "post"): ((400, 401, 409), {}),
}


def _schema_ref(model: Any, components: dict[str, Any]) -> dict[str, Any]:
    """A $ref to `model`, its schema (and the ones it nests) added to the components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def server_openapi(app: FastAPI, generate: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """FastAPI's schema (`generate()`) with the statuses and media types this server really answers."""
    schema = generate()
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _schema_ref(ErrorResponse, components)
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            errors, ok = _ROUTES.get((path, method), ((400,) if "422" in op.get("responses", {}) else (), {}))
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if ok:
                content = {}
                for media, model in ok.items():
                    content[media] = {"schema": _schema_ref(model, components)} if model is not None else \
                        {"schema": {"type": "string"}}
                responses["200"] = {**responses.get("200", {}), "content": content}
            for status in errors:
                responses[str(status)] = {"description": _DESCRIPTIONS[status],
                                          "content": {"application/json": {"schema": _ERROR_REF}}}
    for name in ("HTTPValidationError", "ValidationError"):  # the 422 bodies, never sent
        components.pop(name, None)
    return schema


def install(app: FastAPI) -> None:
    """Serve `server_openapi` at /openapi.json (computed once, as FastAPI does)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = server_openapi(app, generate)
        return app.openapi_schema

    app.openapi = openapi
