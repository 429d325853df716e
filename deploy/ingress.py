"""Ingress: the OpenAI-compatible HTTP API (FastAPI under Ray Serve).

Everything that needs text happens here: auth, body validation, the chat template, tokenization, the text of the
engine's token ids (detokenizing, stop strings, logprob tokens: deploy/output.py), turning it into OpenAI
responses or SSE chunks. Below this deployment there are only token ids.
Every error leaves as OpenAI's error JSON with a fitting status; nothing leaks a stack trace.

Streams (deploy/stream/ingress_side.py): the router decides where a request runs and answers a `Redirect` (with a
single unified engine replica the ingress starts it there itself and tells the router afterwards); the tokens come
straight from that engine replica, through one subscription per engine replica shared by all this replica's requests,
and leave as SSE events written without pydantic (`ChunkEncoder`), several tokens per event when we fell behind.
"""
# No `from __future__ import annotations`: Serve's class-based FastAPI views need real annotation objects
# to recognise `Request` and body models in route signatures.
import asyncio
import hmac
import logging
import os
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy import admin_drain, chat, extras, guard, metrics_endpoint, openapi
from deploy.config import ServeConfig
from deploy.errors import NOT_READY_RETRY_S, ApiError
from deploy.metrics_endpoint import ArrivalStamp
from deploy.prepare import Prepared, Preparer
from deploy.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EngineError, ModelCard,
                             ModelList, Redirect, TokenizeChatRequest, TokenizeCompletionRequest, unknown_fields)
from deploy.output import ChunkText
from deploy.responses import Choice, Responder, apply
from deploy.stream.ingress_side import EngineStreams, SSEResponse, Stream, guarded

logger = logging.getLogger("m3serve.ingress")

API_KEY_ENV = "M3SERVE_API_KEY"
_UNASKED = object()  # the router's `direct_target` not asked yet


app = FastAPI(title="m3serve", description="OpenAI-compatible API for MiniMax-M3 on Ray Serve")
app.add_middleware(ArrivalStamp)  # stamps each request's arrival for the client-visible latency metrics
# the key and the body size, checked before FastAPI reads a byte (deploy/guard.py); added last, so outermost
app.add_middleware(guard.Guard, config_of=lambda: getattr(app.state, "guard", None))
openapi.install(app)  # /openapi.json documents the 400s, SSE and text bodies this server really sends


@app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


@app.exception_handler(chat.ChatRequestError)
async def _chat_request_error(_: Request, exc: chat.ChatRequestError) -> JSONResponse:
    """A request deploy/chat.py or deploy/extras.py cannot serve as asked: 400 naming the field."""
    return ApiError(400, str(exc), param=exc.param, code=exc.code).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic errors -> 400 naming the first offending field (`messages.0.role`), as OpenAI does."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union members show up in the location (`prompt.list[int].0`); keep the field path only.
    loc = [x for x in loc if "[" not in x and x not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    message = f"{param}: {msg}" if param else msg
    if first.get("type") == "json_invalid":
        message = "request body is not valid JSON"
    return ApiError(400, message, param=param, code="invalid_value").response()


@app.exception_handler(guard.BodyTooLarge)
async def _body_too_large(_: Request, exc: guard.BodyTooLarge) -> JSONResponse:
    return ApiError(413, str(exc), code="request_too_large").response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404:
        message = "no such route"
    return ApiError(exc.status_code, message).response()


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")  # the trace goes to the replica log, never to the client
    return ApiError(500, f"internal error ({type(exc).__name__})", code="internal_error").response()


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry (another instance, or this one once restarted)",
                    code="shutting_down", retry_after=NOT_READY_RETRY_S)


def _not_ready_message(state: dict) -> str:
    if state.get("error"):
        return f"not ready: {state['error']}"
    failed = [e for e in state.get("engines", []) if e.get("state") == "failed"]
    if failed:
        return f"not ready: engine {failed[0]['role']}-{failed[0]['replica']} failed to load: {failed[0]['error']}"
    loading = [e for e in state.get("engines", []) if not e.get("ready")]
    return f"not ready: {len(loading)} engine replica(s) still loading"


TINY_MODEL_NAME = "m3-tiny"


def model_name_for(config: ServeConfig, model_dir: str | Path) -> str:
    """The name clients pass as `model`: `config.model_name`, else the checkpoint directory's name (the built-in
    tiny model's cache directory carries a hash, so it is called `m3-tiny`)."""
    if config.model_name:
        return config.model_name
    return TINY_MODEL_NAME if config.model is None else Path(model_dir).name


# ----------------------------------------------------------------------------------------------------------------
# The deployment. It stays last in the module: Serve pickles the decorated class when the decorator runs, and
# module globals defined after that point would be missing in the replica.


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(app)
class Ingress:
    def __init__(self, router: DeploymentHandle, config: ServeConfig, model_dir: str, model_name: str) -> None:
        self._router = router
        self._engines = EngineStreams(router)  # direct streams from the engine replicas (deploy/stream/ingress_side.py)
        self._direct: Redirect | None | object = _UNASKED  # where to start requests without the router, if anywhere
        self._config = config
        self._model_dir = model_dir
        self._model_name = model_name
        self._api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
        app.state.guard = guard.GuardConfig(
            api_key=self._api_key, max_body_bytes=config.max_request_bytes
            or guard.default_max_body_bytes(config.engine.max_model_len))
        self._max_model_len = config.engine.max_model_len
        self._ready = False
        self._drain: asyncio.Future | None = None  # set once the server drains (`drain`): no new requests
        self._log_unknown = extras.UnknownFieldLog(logger)
        self._tokenizer = None
        self._prep: Preparer | None = None  # request checks and engine requests (deploy/prepare.py)
        self._resp: Responder | None = None  # responses and SSE events (deploy/responses.py)
        self._tokenizer_error: str | None = None
        metrics_endpoint.IngressMetrics.install(model_name)
        try:
            from workers.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(model_dir)
            self._prep = Preparer(self._tokenizer, config, extras.sampling_defaults(model_dir))
            self._resp = Responder(self._tokenizer)
        except Exception as e:  # served as 503 with the reason, not a crash loop
            logger.exception("tokenizer failed to load from %s", model_dir)
            self._tokenizer_error = f"{type(e).__name__}: {e}"

    def __del__(self) -> None:
        # Serve calls this when the replica shuts down: end the engine subscriptions, so the engine replicas
        # abort what still ran on them and can shut down without waiting for these streams.
        try:
            self._engines.close()
        except Exception:
            pass

    # -- common checks --------------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def _readiness(self, *, fresh: bool = False) -> dict:
        """The engines' state. Requests read a cached success (one router call per request would be waste);
        `fresh` (/health) asks the engines now, and a not-ready answer clears the cache, so the probe and the
        requests after it see an engine that died or restarts (the first success used to be cached for good)."""
        if self._tokenizer_error is not None:
            return {"ready": False, "error": f"tokenizer failed to load: {self._tokenizer_error}", "engines": []}
        if self._ready and not fresh:
            return {"ready": True, "engines": []}
        try:
            state = await self._router.ready.remote()
        except Exception as e:
            self._ready = False
            return {"ready": False, "error": f"router unreachable ({type(e).__name__})", "engines": []}
        self._ready = bool(state["ready"])
        if state["ready"]:
            lens = [e.get("max_model_len") for e in state["engines"] if e.get("max_model_len")]
            if lens:
                self._max_model_len = min(lens)
                if self._prep is not None:
                    self._prep.max_model_len = self._max_model_len
        return state

    async def _check_ready(self) -> None:
        if self._drain is not None:
            raise _shutting_down()
        state = await self._readiness()
        if not state["ready"]:
            raise ApiError(503, _not_ready_message(state), code="not_ready", retry_after=NOT_READY_RETRY_S)

    def _check_model(self, model: str | None) -> str:
        if model is not None and model != self._model_name:
            raise ApiError(404, f"model: the model '{model}' does not exist (this server has "
                                f"'{self._model_name}')", param="model", code="model_not_found")
        return self._model_name

    # -- routes ---------------------------------------------------------------------------------------------
    @app.head("/health")
    async def health_head(self) -> JSONResponse:
        return await self.health()

    @app.get("/health")
    @app.get("/health/ready")
    async def health(self) -> JSONResponse:
        """Readiness (Kubernetes' sense: send traffic here): every engine answers ready now and the server is not
        draining. 503 while an engine loads, restarts or is dead, and from the moment a drain starts."""
        if self._drain is not None:
            return _shutting_down().response()
        state = await self._readiness(fresh=True)
        if state["ready"]:
            return JSONResponse({"status": "ok", "model": self._model_name})
        return ApiError(503, _not_ready_message(state), code="not_ready", retry_after=NOT_READY_RETRY_S).response()

    @app.head("/health/ready")
    async def ready_head(self) -> JSONResponse:
        return await self.health()

    @app.get("/health/live")
    @app.head("/health/live")
    async def live(self) -> JSONResponse:
        """Liveness (restart me if this fails): this process answers HTTP. Not the engines' state: a restarting
        engine is Serve's to replace, and restarting the pod over it would only lose more work."""
        return JSONResponse({"status": "alive", "draining": self._drain is not None})

    async def drain(self, grace_s: float) -> dict:
        """The server is stopping (`m3serve serve` got SIGTERM): refuse new requests (503 + Retry-After, readiness
        503), give those in flight `grace_s` to finish, end the rest with a 503 `shutting_down` error (an SSE error
        event, then [DONE]), then close the engine subscriptions. Called once per replica; later calls wait for
        the same drain."""
        if self._drain is None:
            error = EngineError(status=503, code="shutting_down", retry_after=NOT_READY_RETRY_S,
                                message=f"the server is shutting down and the request did not finish within its "
                                        f"grace period ({grace_s:g} s); retry")
            self._drain = asyncio.ensure_future(self._engines.drain(grace_s, error))
        counts = await asyncio.shield(self._drain)
        self._engines.close()
        return {**counts, "replica": serve.get_replica_context().replica_id.unique_id}

    @app.post(admin_drain.ROUTE)
    async def drain_route(self, request: Request) -> JSONResponse:
        """Drain this replica now (Kubernetes' preStop hook; deploy/admin_drain.py); answers when it is over."""
        self._check_auth(request)
        return await admin_drain.handle(request, self.drain, self._config.drain_grace_s)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._check_auth(request)
        # root: the served name, never the checkpoint's path on the server's disk
        card = ModelCard(id=self._model_name, root=self._model_name, max_model_len=self._max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        self._check_auth(request)
        self._check_model(model_id)
        card = ModelCard(id=self._model_name, root=self._model_name, max_model_len=self._max_model_len)
        return JSONResponse(card.model_dump(mode="json"))

    @app.get("/version")
    async def version(self) -> JSONResponse:
        return JSONResponse({"version": extras.server_version()})

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request):
        """vLLM's /tokenize: a prompt, or messages rendered as chat completions renders them."""
        self._check_auth(request)
        self._log_unknown(unknown_fields(body))
        self._check_model(body.model)
        await self._check_ready()  # max_model_len is the engines' (known once they loaded)
        return JSONResponse(extras.tokenize(self._tokenizer, body, self._config.chat_template_kwargs,
                                            self._max_model_len))

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request):
        self._check_auth(request)
        self._log_unknown(unknown_fields(body))
        self._check_model(body.model)
        await self._check_ready()
        return JSONResponse(extras.detokenize(self._tokenizer, body))

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every replica's series of the app, vLLM's names where vLLM has them (deploy/metrics_endpoint.py)."""
        families = await metrics_endpoint.gather(self._config, metrics_endpoint.local_families())
        body, content_type = metrics_endpoint.exposition(families, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/admin/stats")
    async def admin_stats(self, request: Request) -> JSONResponse:
        """Every engine replica's stats (pages, queues): for operators and for the leak checks of the tests."""
        self._check_auth(request)
        rows = await self._router.stats.remote()
        out = []
        for row in rows:
            s = row["stats"]
            out.append({"role": row["role"], "replica": row["replica"], "inflight": row["inflight"],
                        "counters": row["counters"],
                        "stats": None if s is None else {**vars(s), "kv_cache_usage": s.kv_cache_usage}})
        return JSONResponse({"engines": out})

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_auth(request)
        self._log_unknown(unknown_fields(body))
        model = self._check_model(body.model)
        await self._check_ready()
        prep = self._prep.completion(body, model)
        streams = await self._start(prep)
        if prep.stream:
            return self._sse(self._resp.completion_events(prep, streams), streams)
        choices = await self._collect(prep, streams)
        return JSONResponse(self._resp.completion_response(prep, choices, streams).model_dump(mode="json"))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_auth(request)
        self._log_unknown(unknown_fields(body))
        model = self._check_model(body.model)
        await self._check_ready()
        prep = self._prep.chat(body, model)
        streams = await self._start(prep)
        if prep.stream:
            return self._sse(self._resp.chat_events(prep, streams), streams)
        choices = await self._collect(prep, streams)
        return JSONResponse(self._resp.chat_response(prep, choices).model_dump(mode="json"))

    # -- talking to the router ------------------------------------------------------------------------------
    async def _direct_target(self) -> Redirect | None:
        """The router's `direct_target`, asked once (a failed ask is asked again with the next request)."""
        if self._direct is _UNASKED:
            try:
                self._direct = await self._router.direct_target.remote()
            except Exception as e:  # noqa: BLE001 - the router decides this request, as before
                logger.warning("router.direct_target failed: %r", e)
                return None
        return self._direct

    async def _start(self, prep: Prepared) -> list[Stream]:
        """Send every prompt to the router and wait for each one's first event, so that a refusal (400, 429,
        503) becomes the HTTP status before any byte of a stream is sent."""
        requests = prep.engine_requests()
        target = None if self._config.disaggregate else await self._direct_target()
        if target is not None:  # one unified replica: started there at once, the router told afterwards
            calls = [self._engines.direct(target, r) for r in requests]
        elif self._config.disaggregate:  # prefill's first token comes through the router, then a redirect
            released = self._engines.take_released()  # ended direct streams, told to the router with this call
            router = self._router.options(stream=True)
            calls = [router.generate.remote(r, released if i == 0 else (), self._engines.owner)
                     for i, r in enumerate(requests)]
        else:
            released = self._engines.take_released()
            calls = [self._router.route.remote(r, released if i == 0 else (), self._engines.owner)
                     for i, r in enumerate(requests)]
        # the engines send token ids; each stream makes their text (deploy/output.py)
        streams = [Stream(call, r.request_id, self._engines, ChunkText(self._tokenizer, r.prompt_token_ids, r.params))
                   for call, r in zip(calls, requests)]
        try:
            await asyncio.gather(*(s.receive_first() for s in streams))
        except BaseException:  # the client left while we waited: the streams owe aborts and releases
            for s in streams:
                s.close()
            raise
        errors = [s.first for s in streams if isinstance(s.first, (EngineError, BaseException))]
        if not errors:
            return streams
        for s in streams:
            s.close()
        # A refusal from an engine says more than a transport failure of another prompt's request.
        engine_error = next((e for e in errors if isinstance(e, EngineError)), None)
        if engine_error is not None:
            raise ApiError.from_engine(engine_error)
        logger.error("engine call failed: %r", errors[0])
        raise ApiError(503, f"engine unavailable ({type(errors[0]).__name__})", code="engine_unavailable",
                       retry_after=NOT_READY_RETRY_S)

    async def _collect(self, prep: Prepared, streams: list[Stream]) -> list[list[Choice]]:
        """Run every stream to its end: per prompt, its choices."""
        async def one(stream: Stream) -> list[Choice]:
            choices = [Choice(index=i) for i in range(prep.params.n)]
            async for chunk in stream.chunks():
                apply(choices, chunk)
            return choices

        try:
            return list(await asyncio.gather(*(one(s) for s in streams)))
        except ApiError:
            raise
        except Exception as e:
            logger.error("engine stream failed: %r", e)
            raise ApiError(503, f"engine failed mid-request ({type(e).__name__})", code="engine_unavailable",
                           retry_after=NOT_READY_RETRY_S) from None
        finally:
            for s in streams:
                s.close()

    # -- streaming ------------------------------------------------------------------------------------------
    @staticmethod
    def _sse(events: AsyncIterator[str], streams: list[Stream]) -> StreamingResponse:
        return SSEResponse(guarded(events), streams)
