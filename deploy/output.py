"""The ingress's output processor: all text of a response, made from the engine's token ids.

An engine streams token ids, their logprobs and each sample's finish (no text). Per engine request, `ChunkText`
turns each `EngineChunk` into what the client is shown: it detokenizes every sample incrementally and looks for
the request's stop strings (workers/text.py, the code the offline `LLM` runs too), holding back text that may
still become a stop string. A stop string ends its sample at the token that completed it: the chunk carries that
sample's finish (reason "stop", stop_reason the string) and nothing after it, and the caller tells the engine to
stop the sample (`EngineStreams.stop`), as vLLM's frontend aborts a request whose stop string it found.
Logprob entries name their tokens by text (`TokenText`, `completion_logprobs`, `chat_logprobs`).

Reasoning and tool-call parsers run on this text afterwards (deploy/chat.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from deploy.protocol import (
    ChatLogprobEntry, ChatLogprobs, CompletionLogprobs, EngineChunk, SampleDelta, TopLogprob,
)
from workers.request import SamplingParams
from workers.text import RequestText
from workers.tokenizer import Tokenizer


class ChunkText:
    """One engine request's text at the ingress (every sample of it)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._text = RequestText(tokenizer, prompt_token_ids, params)

    @property
    def finished(self) -> bool:
        """Every sample finished (the engine's finish, or a stop string found here)."""
        return self._text.finished

    def apply(self, chunk: EngineChunk) -> list[tuple[int, str]]:
        """Give `chunk`'s samples their text (in place): tokens after a stop string are dropped, a sample that
        finished here carries its finish, one finished before is left out; `chunk.finished` once every sample
        finished. Returns the (sample index, stop string) pairs a stop string ended in this chunk."""
        samples, stops = [], []
        for s in chunk.samples:
            d = self._text.add(s.index, s.token_ids, s.logprobs, s.finish_reason, s.stop_reason)
            if d.token_ids or d.text or d.finish_reason is not None:
                samples.append(SampleDelta(index=d.index, token_ids=d.token_ids, text=d.text, logprobs=d.logprobs,
                                           finish_reason=d.finish_reason, stop_reason=d.stop_reason))
            if d.stop_hit:
                stops.append((d.index, d.stop_reason))
        chunk.samples = samples
        chunk.finished = chunk.finished or self._text.finished
        return stops


class TokenText:
    """Token id -> display string for logprobs, cached (the same ids recur)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode_token(token_id)
            self._cache[token_id] = s
        return s


def top_logprobs(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float] | None], top_n: int,
                        text_of: Callable[[int], str], offset0: int = 0) -> CompletionLogprobs:
    """OpenAI legacy logprobs for `token_ids`; a None entry (first prompt token) has no logprob."""
    out = CompletionLogprobs()
    offset = offset0
    for tid, lp in zip(token_ids, logprobs):
        s = text_of(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.get(tid))
        out.top_logprobs.append({text_of(t): v for t, v in top_logprobs(lp, top_n)})
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top_n: int,
                  text_of: Callable[[int], str]) -> ChatLogprobs:
    entries = []
    for tid, lp in zip(token_ids, logprobs):
        s = text_of(tid)
        tops = [TopLogprob(token=text_of(t), logprob=v, bytes=list(text_of(t).encode("utf-8")))
                for t, v in top_logprobs(lp, top_n)]
        entries.append(ChatLogprobEntry(token=s, logprob=lp.get(tid, float("-inf")), bytes=list(s.encode("utf-8")),
                                        top_logprobs=tops))
    return ChatLogprobs(content=entries)
