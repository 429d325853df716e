"""A request's text from its token ids: incremental detokenizing and stop strings, outside the engine.

The engine hands out token ids (with their logprobs and why a sample finished); the text is made where it is
shown: in the ingress (deploy/output.py, per engine stream) and in the offline `LLM` (workers/llm.py). Both drive
one `RequestText` per request with each sample's new tokens:

    text = RequestText(tokenizer, prompt_token_ids, params)
    delta = text.add(index, new_token_ids, new_logprobs, finish_reason, stop_reason)   # a SampleText delta
    if delta.stop_hit: tell the engine to stop sample `index` (its later tokens are not the client's)

A stop string is searched token by token, so a hit ends the sample exactly at the token that completed it (the
tokens after it, which the engine produced before it heard of the stop, are dropped here); the text ends before
the stop string (or after it, with `include_stop_str_in_output`). Until a sample finishes, the last
`len(longest stop) - 1` characters are held back: a later token may complete a stop string there, and text once
shown is never taken back.

Not thread-safe; one per request. Imports only the tokenizer: the ingress (deploy/) and the `LLM` share it, the
engine step never touches it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.request import SamplingParams
from workers.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string, stop_holdback


@dataclass(slots=True)
class TextDelta:
    """What one `RequestText.add` made of a sample's new tokens: the tokens (and logprobs) that belong to the
    output (a stop string drops those after the one completing it), the text now safe to show, and the sample's
    finish. `stop_hit`: a stop string finished the sample in this delta (the engine has not: tell it)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    stop_hit: bool = False


class SampleText:
    """One sample's text so far: detokenizer, the text (shown and held back), and whether it finished."""

    __slots__ = ("_detok", "_params", "_holdback", "text", "shown", "num_tokens", "finish_reason", "stop_reason")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._params = params
        self._holdback = stop_holdback(params.stop)
        self.text = ""  # everything decoded (and kept) so far, held-back characters included
        self.shown = 0  # characters of `text` already handed out
        self.num_tokens = 0  # tokens kept in the output
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, index: int, token_ids: Sequence[int], logprobs: list[dict[int, float]] | None,
            finish_reason: str | None, stop_reason: int | str | None) -> TextDelta:
        """Append the engine's new tokens of this sample (`finish_reason`: the engine finished it with the last
        of them); a finished sample takes nothing more (empty delta)."""
        if self.finished:
            return TextDelta(index, [], None if logprobs is None else [], "", None, None)
        kept = len(token_ids)
        stop_hit = False
        if self._params.stop:
            # token by token: a hit ends the output at the token that completed the stop string
            for j, tid in enumerate(token_ids):
                start = len(self.text)
                piece = self._detok.add_one(int(tid))
                if not piece:
                    continue
                self.text += piece
                if finish_reason == "stop" and j == len(token_ids) - 1:
                    break  # an EOS / stop id already ended it: that is the stop reason
                if self._stop_at(start):
                    kept, stop_hit = j + 1, True
                    break
        else:
            self.text += self._detok.add(token_ids)
        self.num_tokens += kept
        if not stop_hit and finish_reason is not None:
            self.text += self._detok.flush()
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        end = len(self.text) if self.finished else max(len(self.text) - self._holdback, self.shown)
        delta = TextDelta(index, list(token_ids[:kept]), None if logprobs is None else list(logprobs[:kept]),
                          self.text[self.shown:end], self.finish_reason, self.stop_reason, stop_hit)
        self.shown = end
        return delta

    def _stop_at(self, new_text_start: int) -> bool:
        """Whether a stop string ends in the text from `new_text_start` on; if so, cut the text there and
        finish the sample with it."""
        hit = find_stop_string(self.text, self._params.stop, new_text_start)
        if hit is None:
            return False
        idx, stop = hit
        self.text = self.text[:idx + len(stop) if self._params.include_stop_str_in_output else idx]
        self.finish_reason, self.stop_reason = "stop", stop
        return True


class RequestText:
    """The text of every sample of one request (`params.n` of them)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.samples = [SampleText(tokenizer, prompt_token_ids, params) for _ in range(params.n)]

    def add(self, index: int, token_ids: Sequence[int], logprobs: list[dict[int, float]] | None = None,
            finish_reason: str | None = None, stop_reason: int | str | None = None) -> TextDelta:
        return self.samples[index].add(index, token_ids, logprobs, finish_reason, stop_reason)

    @property
    def finished(self) -> bool:
        """Every sample finished (by the engine, or here by a stop string)."""
        return all(s.finished for s in self.samples)
