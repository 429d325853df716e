"""Turning a validated OpenAI body into engine requests: prompts to token ids (the chat template for chat), every
check that needs the tokenizer or the limits (vocabulary, context length, prompt count), and the SamplingParams.

`Preparer.completion` / `Preparer.chat` -> `Prepared`: one engine request per prompt plus what the response needs.
Every refusal is an `ApiError` naming the field. The ingress (deploy/ingress.py) owns one Preparer and keeps its
`max_model_len` current (the engines' own, once they answered ready).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deploy import chat, guided
from deploy.config import ServeConfig
from deploy.errors import ApiError
from deploy.protocol import ChatCompletionRequest, CompletionRequest, EngineRequest, new_id, param_of
from workers.request import SamplingParams
from workers.structured_spec import GrammarSpec

__all__ = ["Prepared", "Preparer", "build_params", "stop_strings"]


@dataclass
class Prepared:
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


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def build_params(body: Any, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
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
            stop=stop_strings(body.stop), stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured=structured, **kwargs)
    except ValueError as e:
        raise ApiError(400, str(e), param=param_of(str(e)), code="invalid_value") from None


class Preparer:
    """Validates and prepares requests with the served tokenizer, `config` and the sampling defaults of the
    checkpoint's generation_config.json."""

    def __init__(self, tokenizer: Any, config: ServeConfig, sampling_defaults: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._config = config
        self.sampling_defaults = sampling_defaults
        self.max_model_len = config.engine.max_model_len

    def _check_prompt(self, ids: list[int], max_tokens: int | None, field_name: str, max_name: str) -> int:
        """Validate one prompt's ids against the vocab and max_model_len; returns the effective max_tokens."""
        if not ids:
            raise ApiError(400, f"{field_name}: the prompt is empty", param=field_name, code="invalid_value")
        vocab = self._tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{field_name}: token id {bad} is outside the vocabulary [0, {vocab})",
                           param=field_name, code="invalid_value")
        limit = self.max_model_len
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

    def _check_common(self, body: Any) -> None:
        # n first: the ingress builds per-sample text state for every choice before the engine's own check
        # answers (n = 10**9 once hung the ingress instead of being refused)
        limit = self._config.engine.max_num_seqs
        if isinstance(body.n, int) and body.n > limit:
            raise ApiError(400, f"n: {body.n} samples exceed what one engine runs at once (max_num_seqs {limit})",
                           param="n", code="invalid_value")
        if body.logit_bias:
            raise ApiError(400, "logit_bias: not supported", param="logit_bias", code="unsupported")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options",
                           code="invalid_value")

    def completion(self, body: CompletionRequest, model: str) -> Prepared:
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
        params = build_params(body, max_tokens=min(effective), logprobs=body.logprobs,
                               prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                               defaults=self.sampling_defaults, structured=guided.request_spec(body))
        # One max_tokens for all prompts when the client gave none: the tightest prompt's room. A client that
        # sets max_tokens gets exactly it (validated above for each prompt).
        return Prepared(id=new_id("cmpl"), model=model, prompts=ids_list, prompt_texts=texts, params=params,
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

    def chat(self, body: ChatCompletionRequest, model: str) -> Prepared:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs",
                           code="invalid_value")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise ApiError(400, f"top_logprobs: must be in [0, 20], got {body.top_logprobs}", param="top_logprobs",
                           code="invalid_value")
        rendered = chat.render_chat(self._tokenizer, body, self._config.chat_template_kwargs)  # its 400s: ChatRequestError, the ingress answers
        text = rendered.text
        ids = self._encode(text, "messages", add_special_tokens=False)
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._check_prompt(ids, requested, "messages", max_name)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        structured = guided.chat_spec(body, rendered.spec.tools, rendered.spec.starts_in_reasoning)
        params = build_params(body, max_tokens=max_tokens, logprobs=top_n, prompt_logprobs=None,
                               defaults=self.sampling_defaults, structured=structured)
        return Prepared(id=new_id("chatcmpl"), model=model, prompts=[ids], prompt_texts=[text], params=params,
                         stream=body.stream, include_usage=bool(body.stream_options and body.stream_options.include_usage),
                         continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
                         return_token_ids=body.return_token_ids, top_n=top_n, output=rendered.spec)
