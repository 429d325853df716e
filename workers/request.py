"""Request-level types shared by the engine, the offline `LLM` API and the serving layer.

These are the engine's contract upward: `deploy/` builds `SamplingParams` from HTTP bodies and reads
`RequestOutput`/`CompletionOutput`. Fields mirror vLLM's so users feel at home.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from workers.structured_spec import GrammarSpec

# integer fields fit a signed 64-bit tensor element (seeds, counts and ids travel to the device as int64)
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request. Validated on construction; errors name the field."""

    n: int = 1
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled token always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # structured output (JSON schema, regex, choice, EBNF, a forced tool call): every sample's tokens follow it
    structured: GrammarSpec | None = None

    def __post_init__(self) -> None:
        """Every field finite and bounded, so nothing a request carries reaches a step unchecked (a NaN
        temperature sampled pad tokens; a top_k past int64 killed the step thread)."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        for name in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not _INT_MIN <= v <= _INT_MAX):
                bad(name, f"must be an integer in [{_INT_MIN}, {_INT_MAX}], got {v!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            bad("repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {_INT_MAX}]")
        if self.structured is not None and not isinstance(self.structured, GrammarSpec):
            bad("structured", f"must be a GrammarSpec, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(kw_only=True)
class CompletionOutput:
    """One sample of a request. `token_ids`/`text` hold everything generated so far (cumulative)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None  # per generated position: token id -> logprob
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


class StepFailedError(RuntimeError):
    """A step that ran this request failed (out of device memory, or any error of the forward); the request is
    gone, the engine serves on. `out_of_memory`: the step ran out of device memory (a shorter prompt or a smaller
    step may fit)."""

    def __init__(self, message: str, *, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory

    def __reduce__(self):  # keyword state survives pickling (a Ray hop)
        return _step_failed, (str(self), self.out_of_memory)


def _step_failed(message: str, out_of_memory: bool) -> StepFailedError:
    return StepFailedError(message, out_of_memory=out_of_memory)


@dataclass(kw_only=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # set when the engine failed the request (finished, every sample's finish_reason "error"); the async engine
    # raises it in the request's stream
    error: StepFailedError | None = None
