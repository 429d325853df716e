"""OpenAI responses from engine chunks: whole completion / chat responses, and their SSE event streams.

The engine chunks arrive with their text already made (deploy/output.py `ChunkText`, run by each stream); here
they become OpenAI's shapes: choices accumulated (`Choice`, `apply`), usage, echo and logprobs (token text through
`TokenText`), chat messages split into content, reasoning and tool calls (deploy/chat.py), and the SSE events of
both endpoints. `Responder` holds the tokenizer and the token-text cache the logprobs need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from deploy import chat
from deploy.output import TokenText, chat_logprobs, completion_logprobs
from deploy.prepare import Prepared
from deploy.protocol import (SSE_DONE, ChatChoice, ChatCompletionResponse, ChunkEncoder, CompletionChoice,
                             CompletionResponse, EngineChunk, UsageInfo, chat_chunk_choice, completion_choice)
from deploy.stream.ingress_side import Stream, interleave

__all__ = ["Choice", "Responder", "apply", "usage_info"]


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def apply(choices: list[Choice], chunk: EngineChunk) -> None:
    for s in chunk.samples:
        c = choices[s.index]
        c.token_ids.extend(s.token_ids)
        c.text += s.text
        if s.logprobs:
            c.logprobs.extend(s.logprobs)
        if s.finish_reason is not None:
            c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason


class Responder:
    """Builds the responses and event streams of prepared requests (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._text_of = TokenText(tokenizer)

    def completion_response(self, prep: Prepared, per_prompt: list[list[Choice]],
                             streams: list[Stream]) -> CompletionResponse:
        out, completion_tokens = [], 0
        prompt_tokens = sum(len(p) for p in prep.prompts)
        for p, (choices, stream) in enumerate(zip(per_prompt, streams)):
            prompt_ids = prep.prompts[p]
            prefix, lp_prefix_ids, lp_prefix = self.echo_prefix(prep, p, stream.first)
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
                                  usage=usage_info(prompt_tokens, completion_tokens))

    def echo_prefix(self, prep: Prepared, p: int, first: EngineChunk) -> tuple[str, list[int], list]:
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

    def chat_response(self, prep: Prepared, per_prompt: list[list[Choice]]) -> ChatCompletionResponse:
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
                                      usage=usage_info(len(prep.prompts[0]), completion_tokens),
                                      prompt_token_ids=prep.prompts[0] if prep.return_token_ids else None)

    async def completion_events(self, prep: Prepared, streams) -> AsyncIterator[str]:
        n = prep.params.n
        prompt_tokens = sum(len(p) for p in prep.prompts)
        generated = 0
        started: set[int] = set()
        enc = ChunkEncoder(id=prep.id, object="text_completion", model=prep.model)
        async for p, chunk in interleave(streams):
            for s in chunk.samples:
                index = p * n + s.index
                text, lp_ids, lp = s.text, list(s.token_ids), list(s.logprobs or [])
                first_of_choice = index not in started
                started.add(index)
                if first_of_choice and prep.echo:
                    prefix, pre_ids, pre_lp = self.echo_prefix(prep, p, streams[p].first)
                    text, lp_ids, lp = prefix + text, pre_ids + lp_ids, pre_lp + lp
                generated += len(s.token_ids)
                logprobs = None
                if prep.top_n is not None:
                    logprobs = completion_logprobs(lp_ids, lp, prep.top_n, self._text_of)
                choice = completion_choice(
                    index=index, text=text, logprobs=logprobs, finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason, token_ids=s.token_ids if prep.return_token_ids else None,
                    prompt_token_ids=prep.prompts[p] if prep.return_token_ids and first_of_choice else None)
                usage = usage_info(prompt_tokens, generated) if prep.continuous_usage and prep.include_usage else None
                yield enc.event([choice], usage)
        if prep.include_usage:
            yield enc.event([], usage_info(prompt_tokens, generated))
        yield SSE_DONE

    async def chat_events(self, prep: Prepared, streams) -> AsyncIterator[str]:
        prompt_tokens = len(prep.prompts[0])
        generated = 0
        enc = ChunkEncoder(id=prep.id, object="chat.completion.chunk", model=prep.model)
        # OpenAI opens each choice with the assistant role and empty content.
        opening = [chat_chunk_choice(index=i, role="assistant", content="") for i in range(prep.params.n)]
        yield enc.event(opening, None, prompt_token_ids=prep.prompts[0] if prep.return_token_ids else None)
        splitters = [chat.ChatStreamSplitter(prep.output or chat.OutputSpec()) for _ in range(prep.params.n)]
        async for _, chunk in interleave(streams):
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
                usage = usage_info(prompt_tokens, generated) if prep.continuous_usage and prep.include_usage else None
                yield enc.event([choice], usage, prompt_token_ids=None)
        if prep.include_usage:
            yield enc.event([], usage_info(prompt_tokens, generated), prompt_token_ids=None)
        yield SSE_DONE
