"""Ingress: the OpenAI-compatible HTTP API (FastAPI under Ray Serve).

Everything that needs text happens here: auth, body validation, the chat template, tokenization, the text of the
engine's token ids (detokenizing, stop strings, logprob tokens: deploy/output.py), turning it into OpenAI
responses or SSE chunks. Below this deployment there are only token ids.
Every error leaves as OpenAI's error JSON with a fitting status; nothing leaks a stack trace.

Streams (deploy/stream.py): the router decides where a request runs and answers a `Redirect`; the tokens then come
straight from that engine replica, through one subscription per engine replica shared by all this replica's requests,
and leave as SSE events written without pydantic (`ChunkEncoder`), several tokens per event when we fell behind.
"""
# No `from __future__ import annotations`: Serve's class-based FastAPI views need real annotation objects
# to recognise `Request` and body models in route signatures.
import asyncio
import hmac
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy import chat, extras, guard, guided, metrics_endpoint, openapi
from deploy.config import ServeConfig
from deploy.errors import NOT_READY_RETRY_S, ApiError
from deploy.metrics_endpoint import ArrivalStamp
from deploy.protocol import (
    SSE_DONE, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChunkEncoder, CompletionChoice,
    CompletionRequest, CompletionResponse, DetokenizeRequest, EngineChunk, EngineError, EngineRequest, ModelCard, ModelList, TokenizeChatRequest, TokenizeCompletionRequest,
    UsageInfo, chat_chunk_choice, completion_choice, new_id, param_of, unknown_fields,
)
from deploy.output import ChunkText, TokenText, chat_logprobs, completion_logprobs
from deploy.stream import EngineStreams, SSEResponse, Stream, guarded, merge
from workers.request import SamplingParams
from workers.structured_spec import GrammarSpec

logger = logging.getLogger("m3serve.ingress")

API_KEY_ENV = "M3SERVE_API_KEY"


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


# ----------------------------------------------------------------------------------------------------------------
# Per-choice accumulation


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# ----------------------------------------------------------------------------------------------------------------
# Prepared requests


@dataclass
class _Prepared:
    """A validated request: one engine request per prompt, plus what the response needs."""

    id: str
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    echo: bool = False
    top_n: int | None = None  # logprobs requested (top-N); None = no logprobs
    output: chat.OutputSpec | None = None  # chat: how to split reasoning and tool calls from the text

    def engine_requests(self) -> list[EngineRequest]:
        return [EngineRequest(request_id=f"{self.id}-{i}", prompt_token_ids=ids, params=self.params, prompt=text)
                for i, (ids, text) in enumerate(zip(self.prompts, self.prompt_texts))]


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _build_params(body: Any, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                  defaults: dict[str, Any] | None = None, structured: GrammarSpec | None = None) -> SamplingParams:
    """`defaults` (generation_config.json's) fill the sampling fields the request left out; `structured`: the
    request's output constraint (deploy/guided.py)."""
    given = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    kwargs = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens, seed=body.seed,
            stop=_stop_strings(body.stop), stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured=structured, **kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param=param_of(str(e)), code="invalid_value") from None


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


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


def _apply(choices: list[_Choice], chunk: EngineChunk) -> None:
    for s in chunk.samples:
        c = choices[s.index]
        c.token_ids.extend(s.token_ids)
        c.text += s.text
        if s.logprobs:
            c.logprobs.extend(s.logprobs)
        if s.finish_reason is not None:
            c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason



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
        self._engines = EngineStreams(router)  # direct streams from the engine replicas (deploy/stream.py)
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
        self._sampling_defaults: dict[str, Any] = {}
        self._tokenizer_error: str | None = None
        metrics_endpoint.IngressMetrics.install(model_name)
        try:
            from workers.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(model_dir)
            self._sampling_defaults = extras.sampling_defaults(model_dir)
            self._text_of = TokenText(self._tokenizer)
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

    def _check_prompt(self, ids: list[int], max_tokens: int | None, field_name: str, max_name: str) -> int:
        """Validate one prompt's ids against the vocab and max_model_len; returns the effective max_tokens."""
        if not ids:
            raise ApiError(400, f"{field_name}: the prompt is empty", param=field_name, code="invalid_value")
        vocab = self._tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{field_name}: token id {bad} is outside the vocabulary [0, {vocab})",
                           param=field_name, code="invalid_value")
        limit = self._max_model_len
        if len(ids) >= limit:
            raise ApiError(400, f"{field_name}: the prompt has {len(ids)} tokens; this model's maximum context "
                                f"length is {limit} tokens, including at least one generated token",
                           param=field_name, code="context_length_exceeded")
        if max_tokens is None:
            return limit - len(ids)
        if max_tokens < 1:
            raise ApiError(400, f"{max_name}: must be >= 1, got {max_tokens}", param=max_name, code="invalid_value")
        if len(ids) + max_tokens > limit:
            raise ApiError(400, f"{max_name}: the prompt has {len(ids)} tokens and {max_name} is {max_tokens}; "
                                f"together they exceed this model's maximum context length of {limit} tokens",
                           param=max_name, code="context_length_exceeded")
        return max_tokens

    @staticmethod
    def _check_common(body: Any) -> None:
        if body.logit_bias:
            raise ApiError(400, "logit_bias: not supported", param="logit_bias", code="unsupported")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options",
                           code="invalid_value")

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
        prep = self._prepare_completion(body, model)
        streams = await self._start(prep)
        if prep.stream:
            return self._sse(self._completion_events(prep, streams), streams)
        choices = await self._collect(prep, streams)
        return JSONResponse(self._completion_response(prep, choices, streams).model_dump(mode="json"))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_auth(request)
        self._log_unknown(unknown_fields(body))
        model = self._check_model(body.model)
        await self._check_ready()
        prep = self._prepare_chat(body, model)
        streams = await self._start(prep)
        if prep.stream:
            return self._sse(self._chat_events(prep, streams), streams)
        choices = await self._collect(prep, streams)
        return JSONResponse(self._chat_response(prep, choices).model_dump(mode="json"))

    # -- preparing ------------------------------------------------------------------------------------------
    def _prepare_completion(self, body: CompletionRequest, model: str) -> _Prepared:
        self._check_common(body)
        if body.suffix is not None:
            raise ApiError(400, "suffix: not supported", param="suffix", code="unsupported")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of: only best_of == n is supported", param="best_of", code="unsupported")
        prompt = body.prompt
        if isinstance(prompt, str):
            raw: list[str | list[int]] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            raw = [list(prompt)]
        else:
            raw = list(prompt)
        if not raw:
            raise ApiError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        self._check_prompt_count(len(raw))
        ids_list, texts = [], []
        max_tokens = body.max_tokens
        for item in raw:
            if isinstance(item, str):
                ids = self._encode(item, "prompt", add_special_tokens=True)
                texts.append(item)
            else:
                ids = list(item)
                texts.append(None)
            ids_list.append(ids)
        effective = [self._check_prompt(ids, max_tokens, "prompt", "max_tokens") for ids in ids_list]
        params = _build_params(body, max_tokens=min(effective), logprobs=body.logprobs,
                               prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                               defaults=self._sampling_defaults, structured=guided.request_spec(body))
        # One max_tokens for all prompts when the client gave none: the tightest prompt's room. A client that
        # sets max_tokens gets exactly it (validated above for each prompt).
        return _Prepared(id=new_id("cmpl"), model=model, prompts=ids_list, prompt_texts=texts, params=params,
                         stream=body.stream, include_usage=bool(body.stream_options and body.stream_options.include_usage),
                         continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                         return_token_ids=body.return_token_ids, echo=body.echo, top_n=body.logprobs)

    def _check_prompt_count(self, count: int) -> None:
        """More prompts than the engines can hold waiting can never be admitted: a 400, not a 429 forever. The
        bound is one replica's `max_waiting` times the fewest replicas of a role (each prompt waits in each role)."""
        limit = self._config.engine.max_waiting * min(g.replicas for g in self._config.groups().values())
        if count > limit:
            raise ApiError(400, f"prompt: {count} prompts in one request; this server can hold at most {limit} "
                                f"waiting, so the request could never be admitted (send at most {limit})",
                           param="prompt", code="invalid_value")

    def _encode(self, text: str, field_name: str, *, add_special_tokens: bool) -> list[int]:
        # JSON may carry a lone surrogate ("\ud800"): valid JSON, not encodable text (the tokenizer raised a
        # TypeError -> 500); checked here first so the answer names the field
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{field_name}: the text holds a lone UTF-16 surrogate (\\ud800-\\udfff escapes "
                                f"must come in pairs)", param=field_name, code="invalid_value") from None
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _prepare_chat(self, body: ChatCompletionRequest, model: str) -> _Prepared:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs",
                           code="invalid_value")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise ApiError(400, f"top_logprobs: must be in [0, 20], got {body.top_logprobs}", param="top_logprobs",
                           code="invalid_value")
        rendered = chat.render_chat(self._tokenizer, body, self._config.chat_template_kwargs)  # 400s: handler above
        text = rendered.text
        ids = self._encode(text, "messages", add_special_tokens=False)
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._check_prompt(ids, requested, "messages", max_name)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        structured = guided.chat_spec(body, rendered.spec.tools, rendered.spec.starts_in_reasoning)
        params = _build_params(body, max_tokens=max_tokens, logprobs=top_n, prompt_logprobs=None,
                               defaults=self._sampling_defaults, structured=structured)
        return _Prepared(id=new_id("chatcmpl"), model=model, prompts=[ids], prompt_texts=[text], params=params,
                         stream=body.stream, include_usage=bool(body.stream_options and body.stream_options.include_usage),
                         continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                         return_token_ids=body.return_token_ids, top_n=top_n, output=rendered.spec)

    # -- talking to the router ------------------------------------------------------------------------------
    async def _start(self, prep: _Prepared) -> list[Stream]:
        """Send every prompt to the router and wait for each one's first event, so that a refusal (400, 429,
        503) becomes the HTTP status before any byte of a stream is sent."""
        released = self._engines.take_released()  # ended direct streams, told to the router with this call
        requests = prep.engine_requests()
        if self._config.disaggregate:  # prefill's first token comes through the router, then a redirect
            router = self._router.options(stream=True)
            calls = [router.generate.remote(r, True, released if i == 0 else (), self._engines.owner)
                     for i, r in enumerate(requests)]
        else:
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

    async def _collect(self, prep: _Prepared, streams: list[Stream]) -> list[list[_Choice]]:
        """Run every stream to its end: per prompt, its choices."""
        async def one(stream: Stream) -> list[_Choice]:
            choices = [_Choice(index=i) for i in range(prep.params.n)]
            async for chunk in stream.chunks():
                _apply(choices, chunk)
            return choices

        try:
            return list(await asyncio.gather(*(one(s) for s in streams)))
        except ApiError:
            raise
        except Exception as e:
            logger.error("engine stream failed: %r", e)
            raise ApiError(503, f"engine failed mid-request ({type(e).__name__})", code="engine_unavailable") from None
        finally:
            for s in streams:
                s.close()

    # -- responses ------------------------------------------------------------------------------------------
    def _completion_response(self, prep: _Prepared, per_prompt: list[list[_Choice]],
                             streams: list[Stream]) -> CompletionResponse:
        out, completion_tokens = [], 0
        prompt_tokens = sum(len(p) for p in prep.prompts)
        for p, (choices, stream) in enumerate(zip(per_prompt, streams)):
            prompt_ids = prep.prompts[p]
            prefix, lp_prefix_ids, lp_prefix = self._echo_prefix(prep, p, stream.first)
            for c in choices:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if prep.top_n is not None:
                    logprobs = completion_logprobs(lp_prefix_ids + c.token_ids, lp_prefix + c.logprobs, prep.top_n,
                                                   self._text_of)
                out.append(CompletionChoice(
                    index=p * prep.params.n + c.index, text=prefix + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    token_ids=c.token_ids if prep.return_token_ids else None,
                    prompt_token_ids=prompt_ids if prep.return_token_ids else None))
        return CompletionResponse(id=prep.id, model=prep.model, choices=out,
                                  usage=_usage(prompt_tokens, completion_tokens))

    def _echo_prefix(self, prep: _Prepared, p: int, first: EngineChunk) -> tuple[str, list[int], list]:
        """With `echo`: the prompt text, and the prompt tokens with their logprobs to lead the logprobs lists."""
        if not prep.echo:
            return "", [], []
        ids = prep.prompts[p]
        text = prep.prompt_texts[p]
        if text is None:
            text = self._tokenizer.decode(ids, skip_special_tokens=False)
        plp = first.prompt_logprobs
        if plp is None or len(plp) != len(ids):
            plp = [None] * len(ids)
        return text, list(ids), list(plp)

    def _chat_response(self, prep: _Prepared, per_prompt: list[list[_Choice]]) -> ChatCompletionResponse:
        choices = per_prompt[0]
        out = []
        for c in choices:
            logprobs = None
            if prep.top_n is not None:
                logprobs = chat_logprobs(c.token_ids, c.logprobs, prep.top_n, self._text_of)
            message, finish_reason = chat.response_message(c.text, prep.output, c.finish_reason)
            out.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                  finish_reason=finish_reason, stop_reason=c.stop_reason,
                                  token_ids=c.token_ids if prep.return_token_ids else None))
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return ChatCompletionResponse(id=prep.id, model=prep.model, choices=out,
                                      usage=_usage(len(prep.prompts[0]), completion_tokens),
                                      prompt_token_ids=prep.prompts[0] if prep.return_token_ids else None)

    # -- streaming ------------------------------------------------------------------------------------------
    @staticmethod
    def _sse(events: AsyncIterator[str], streams: list[Stream]) -> StreamingResponse:
        return SSEResponse(guarded(events), streams)

    async def _completion_events(self, prep: _Prepared, streams) -> AsyncIterator[str]:
        n = prep.params.n
        prompt_tokens = sum(len(p) for p in prep.prompts)
        generated = 0
        started: set[int] = set()
        enc = ChunkEncoder(id=prep.id, object="text_completion", model=prep.model)
        async for p, chunk in merge(streams):
            for s in chunk.samples:
                index = p * n + s.index
                text, lp_ids, lp = s.text, list(s.token_ids), list(s.logprobs or [])
                first_of_choice = index not in started
                started.add(index)
                if first_of_choice and prep.echo:
                    prefix, pre_ids, pre_lp = self._echo_prefix(prep, p, streams[p].first)
                    text, lp_ids, lp = prefix + text, pre_ids + lp_ids, pre_lp + lp
                generated += len(s.token_ids)
                logprobs = None
                if prep.top_n is not None:
                    logprobs = completion_logprobs(lp_ids, lp, prep.top_n, self._text_of)
                choice = completion_choice(
                    index=index, text=text, logprobs=logprobs, finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason, token_ids=s.token_ids if prep.return_token_ids else None,
                    prompt_token_ids=prep.prompts[p] if prep.return_token_ids and first_of_choice else None)
                usage = _usage(prompt_tokens, generated) if prep.continuous_usage and prep.include_usage else None
                yield enc.event([choice], usage)
        if prep.include_usage:
            yield enc.event([], _usage(prompt_tokens, generated))
        yield SSE_DONE

    async def _chat_events(self, prep: _Prepared, streams) -> AsyncIterator[str]:
        prompt_tokens = len(prep.prompts[0])
        generated = 0
        enc = ChunkEncoder(id=prep.id, object="chat.completion.chunk", model=prep.model)
        # OpenAI opens each choice with the assistant role and empty content.
        opening = [chat_chunk_choice(index=i, role="assistant", content="") for i in range(prep.params.n)]
        yield enc.event(opening, None, prompt_token_ids=prep.prompts[0] if prep.return_token_ids else None)
        splitters = [chat.ChatStreamSplitter(prep.output or chat.OutputSpec()) for _ in range(prep.params.n)]
        async for _, chunk in merge(streams):
            for s in chunk.samples:
                generated += len(s.token_ids)
                logprobs = None
                if prep.top_n is not None:
                    logprobs = chat_logprobs(s.token_ids, s.logprobs or [], prep.top_n, self._text_of)
                split = splitters[s.index]
                piece = split.feed(s.text, final=s.finish_reason is not None)
                choice = chat_chunk_choice(index=s.index, **piece.delta_fields(), logprobs=logprobs,
                                           finish_reason=chat.finish_reason(s.finish_reason, split.made_calls),
                                           stop_reason=s.stop_reason,
                                           token_ids=s.token_ids if prep.return_token_ids else None)
                usage = _usage(prompt_tokens, generated) if prep.continuous_usage and prep.include_usage else None
                yield enc.event([choice], usage, prompt_token_ids=None)
        if prep.include_usage:
            yield enc.event([], _usage(prompt_tokens, generated), prompt_token_ids=None)
        yield SSE_DONE
