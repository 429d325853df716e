"""Plain stats dataclasses the engines return; only `deploy/metrics.py` turns them into Prometheus metrics.

Times are `time.monotonic()` seconds on the process that produced them, except `arrival_time`-relative
durations, which are already differences. Nothing here imports a metrics library.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class RequestStats:
    """One finished (or failed) request, as its engine saw it. Durations in seconds."""

    request_id: str
    role: str = "unified"  # unified | prefill | decode
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_reason: str | None = None  # stop | length | abort | error
    failure_reason: str | None = None  # set when the request failed: error | transfer | timeout | ...
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # monotonic time of each generated token
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def time_per_output_token(self) -> float | None:
        """Decode time over the tokens after the first (vLLM's TPOT); None for 0 or 1 generated tokens."""
        if self.generation_tokens < 2 or self.decode_time is None:
            return None
        return self.decode_time / (self.generation_tokens - 1)


@dataclass(kw_only=True)
class StepStats:
    """One engine step."""

    step_time: float  # seconds for schedule + execute + update
    host_overhead: float  # seconds of that spent outside the model forward (scheduling, batching, sampling glue)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    batch_size: int = 0  # requests in the step
    num_preemptions: int = 0
    # time.time() when the step began, set by the loop that drives the engine (AsyncEngine); wall clock rather than
    # monotonic so steps line up with other processes' timelines and the benchmark client's (debug_timeline)
    start_time: float | None = None


@dataclass(kw_only=True)
class EngineStats:
    """A snapshot of one engine's state, for gauges and health."""

    role: str = "unified"
    num_running: int = 0
    num_waiting: int = 0
    num_pages_total: int = 0
    num_pages_free: int = 0
    num_pages_cached: int = 0  # free but holding reusable prefix pages
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found cached
    num_preemptions: int = 0  # cumulative

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of pages in use by requests (0..1)."""
        if self.num_pages_total == 0:
            return 0.0
        return 1.0 - self.num_pages_free / self.num_pages_total


@dataclass(kw_only=True)
class TransferStats:
    """One KV transfer between a prefill and a decode group."""

    request_id: str
    num_bytes: int
    seconds: float
    num_pages: int
    ok: bool = True
