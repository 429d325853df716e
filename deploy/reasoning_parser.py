"""MiniMax-M3 reasoning: split `<mm:think>` ... `</mm:think>` from the answer, whole or streamed.

M3 writes its reasoning at the start of an assistant turn between `<mm:think>` and `</mm:think>`
(../shared/M3_SPEC.md section 7). With thinking on, the chat template may already have written the opening tag
into the prompt, so generation starts inside the reasoning (`starts_in_reasoning=True`; the ingress can tell
from the rendered prompt with `prompt_starts_in_reasoning`). With thinking off the model may write the closing
tag alone, or nothing. Hand-written: it is a two-tag split that must also work on deltas split anywhere (a tag
may arrive one character at a time), which no maintained library does for this tag pair.

Rules (text verbatim, whitespace included; never an exception):
- `starts_in_reasoning=True`: a redundant `<mm:think>` at the very start (after optional whitespace, dropped
  with it) is skipped; the reasoning runs to the first `</mm:think>`, the content is everything after it. No
  closing tag (truncated thinking): everything is reasoning.
- `starts_in_reasoning=False`: only a tag at the very start (after optional whitespace) counts. `<mm:think>`
  there opens reasoning as above; `</mm:think>` there is dropped (thinking off); otherwise the whole text is
  content, any tag later in it included.
- `reasoning` is None when there is no reasoning text (no section, or an empty one).
The streaming parser holds back only what could still be a tag (and the leading whitespace before a possible
start tag), so its deltas concatenate to the non-streaming result for any split.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"
_START, _START_IN, _REASONING, _CONTENT = "start", "start_in_reasoning", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningResult:
    """Non-streaming result: `reasoning` (None when empty) and `content` ("" when none)."""
    reasoning: str | None
    content: str


@dataclass(frozen=True)
class ReasoningDelta:
    """What one `feed` or `finish` settled: reasoning text and content text (either may be "")."""
    reasoning: str = ""
    content: str = ""


def prompt_starts_in_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside reasoning (the template wrote `<mm:think>` last)."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _lstrip_len(text: str) -> int:
    return len(text) - len(text.lstrip())


def parse_reasoning(text: str, starts_in_reasoning: bool = False) -> ReasoningResult:
    j = _lstrip_len(text)
    if not starts_in_reasoning:
        if text.startswith(THINK_CLOSE, j):
            return ReasoningResult(None, text[j + len(THINK_CLOSE):])
        if not text.startswith(THINK_OPEN, j):
            return ReasoningResult(None, text)
    body = text[j + len(THINK_OPEN):] if text.startswith(THINK_OPEN, j) else text
    reasoning, closed, content = body.partition(THINK_CLOSE)
    return ReasoningResult(reasoning or None, content if closed else "")


def _partial_suffix(text: str, pattern: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `pattern`."""
    for k in range(min(len(text), len(pattern) - 1), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


class ReasoningStreamParser:
    """Streaming split: `feed(delta)` per text delta, `finish()` once; each returns a ReasoningDelta."""

    def __init__(self, starts_in_reasoning: bool = False):
        self._state = _START_IN if starts_in_reasoning else _START
        self._buf = ""
        self._finished = False

    def feed(self, text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("ReasoningStreamParser: feed() after finish()")
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        if self._state in (_START, _START_IN):
            self._decide_start()
        if self._state == _REASONING:
            i = self._buf.find(THINK_CLOSE)
            if i >= 0:
                reasoning.append(self._buf[:i])
                self._buf = self._buf[i + len(THINK_CLOSE):]
                self._state = _CONTENT
            else:
                n = len(self._buf) - _partial_suffix(self._buf, THINK_CLOSE)
                reasoning.append(self._buf[:n])
                self._buf = self._buf[n:]
        if self._state == _CONTENT:
            content.append(self._buf)
            self._buf = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """End of output: held text is what it literally is (a tag never completed is text)."""
        self._finished = True
        held, self._buf = self._buf, ""
        if self._state in (_START_IN, _REASONING):
            return ReasoningDelta(held, "")
        return ReasoningDelta("", held)

    def _decide_start(self) -> None:
        """At the start of the output: is there a tag after the leading whitespace? Hold until it is known."""
        buf = self._buf
        j = _lstrip_len(buf)
        rest = buf[j:]
        tags = (THINK_OPEN,) if self._state == _START_IN else (THINK_OPEN, THINK_CLOSE)
        if not rest or any(t.startswith(rest) and t != rest for t in tags):
            return
        if rest.startswith(THINK_OPEN):
            self._buf, self._state = rest[len(THINK_OPEN):], _REASONING
        elif rest.startswith(THINK_CLOSE) and self._state == _START:
            self._buf, self._state = rest[len(THINK_CLOSE):], _CONTENT
        else:
            self._state = _REASONING if self._state == _START_IN else _CONTENT
