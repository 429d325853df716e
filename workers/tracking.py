"""The engine core's table of its requests: what it keeps of each beyond the scheduler's state.

`EngineCore` (workers/core.py) schedules and updates; this table holds the bookkeeping around that: each request's
stats (closed into a `RequestStats` when it ends), its prompt logprobs as they arrive, its grammar states, whether
its rows need host tokens (no step ahead while one does), the requests the latest update retired (a stop string
found after the step may still restate their finish), and the sequence ids released since the last batch (the
shards drop their sampler state). Pure Python, owned by one core, driven by its thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from workers.request import SamplingParams
from workers.scheduler import Request, Sequence as Seq
from workers.stats import RequestStats
from workers.structured import GrammarState


def needs_host_tokens(params: SamplingParams) -> bool:
    """Whether a request's batch rows need its previous token on the host (a grammar's bitmask, a penalty's token
    lists): while one is in flight the engine schedules synchronously (no step ahead)."""
    return (params.structured is not None or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


@dataclass(eq=False)
class Tracked:
    """The core's state of one request beyond the scheduler's: stats and prompt logprobs."""

    req: Request
    stats: RequestStats
    token_times: list[float] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # position 0 is None (nothing predicts it)
    # structured output: one grammar state per sample (index = Sequence.index), advanced by each token the core
    # appends (never by a recompute, which samples nothing new); None when the request is unconstrained
    grammars: list[GrammarState] | None = None

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.req.prompt_token_ids)

    def record_token(self, now: float) -> None:
        if self.stats.first_token_time is None:
            self.stats.first_token_time = now
        self.token_times.append(now)

    def close_stats(self, reason: str | None) -> RequestStats:
        """The request ended (`reason`: how; None: from its samples' finish reasons): its stats, complete."""
        s, req = self.stats, self.req
        s.generation_tokens = sum(q.num_output_tokens for q in req.seqs)
        s.finished_reason = reason or finished_reason(req)
        s.finished_time = time.monotonic()
        s.token_times = self.token_times
        s.num_preemptions = sum(q.num_preemptions for q in req.seqs)
        s.prefix_cache_hit_tokens = req.prefix_cache_hit_tokens
        s.first_scheduled_time = req.first_scheduled_time
        return s


def finished_reason(req: Request) -> str:
    reasons = [q.finish_reason for q in req.seqs]
    return "stop" if "stop" in reasons else reasons[0]


class RequestTable:
    """The requests in flight of one core (request id -> `Tracked`), and what their ends left for others: closed
    stats (`pop_stats`), released sequence ids (`take_released`), the latest update's retired requests."""

    def __init__(self, role: str) -> None:
        self._role = role
        self._live: dict[str, Tracked] = {}
        self._prompt_logprob_pending: dict[str, Tracked] = {}
        self._needs_host_tokens: set[str] = set()  # requests whose next batch needs their last token on the host
        self._released_seq_ids: list[int] = []  # gone since the last batch: the shards drop their sampler state
        self._finished_stats: list[RequestStats] = []
        self._retired_now: dict[str, Tracked] = {}  # retired by the latest update (a stop string may follow)

    # ---- membership -------------------------------------------------------------------------------------
    def add(self, req: Request, grammars: list[GrammarState] | None) -> Tracked:
        params = req.params
        t = Tracked(req=req, stats=RequestStats(request_id=req.request_id, role=self._role,
                                                prompt_tokens=len(req.prompt_token_ids),
                                                arrival_time=req.arrival_time),
                    prompt_logprobs=[None] if params.prompt_logprobs is not None else None, grammars=grammars)
        self._live[req.request_id] = t
        if needs_host_tokens(params):
            self._needs_host_tokens.add(req.request_id)
        if params.prompt_logprobs is not None and len(req.prompt_token_ids) > 1:
            self._prompt_logprob_pending[req.request_id] = t
        return t

    def get(self, request_id: str) -> Tracked | None:
        return self._live.get(request_id)

    def __getitem__(self, request_id: str) -> Tracked:
        return self._live[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def ids(self) -> list[str]:
        return list(self._live)

    def drop(self, request_id: str) -> Tracked | None:
        """Forget a request without closing anything (an abort closes its stats itself)."""
        self._prompt_logprob_pending.pop(request_id, None)
        self._needs_host_tokens.discard(request_id)
        return self._live.pop(request_id, None)

    # ---- ends -------------------------------------------------------------------------------------------
    def ended(self, req: Request, t: Tracked | None, reason: str | None) -> None:
        """`req` ended (retired or aborted; already dropped): its sequences are released and its stats closed."""
        self._released_seq_ids.extend(s.seq_id for s in req.seqs)
        if t is not None:
            self._finished_stats.append(t.close_stats(reason))

    def retire(self, t: Tracked) -> None:
        """Every sample finished: forget the request, close its stats; a stop string may still restate it."""
        self.drop(t.req.request_id)
        self._retired_now[t.req.request_id] = t
        self.ended(t.req, t, None)

    def begin_update(self) -> None:
        self._retired_now = {}

    def live_or_retired_now(self, request_id: str) -> tuple[Tracked | None, bool]:
        """The request in flight, else the one the latest update retired (then True)."""
        t = self._live.get(request_id) or self._retired_now.get(request_id)
        return t, request_id in self._retired_now

    # ---- what the step needs ----------------------------------------------------------------------------
    @property
    def any_needs_host_tokens(self) -> bool:
        return bool(self._needs_host_tokens)

    def prompt_logprob_progress(self) -> dict[int, int]:
        """Sequence id -> how many prompt positions have logprobs, for requests still collecting them."""
        return {t.req.seqs[0].seq_id: len(t.prompt_logprobs) for t in self._prompt_logprob_pending.values()}

    def on_prompt_logprobs(self, request_id: str, start: int, dicts: list[dict[int, float]]) -> None:
        t = self._prompt_logprob_pending.get(request_id)
        if t is None:
            return
        for j, d in enumerate(dicts):
            if start + 1 + j == len(t.prompt_logprobs):  # in order, each position once (recompute repeats some)
                t.prompt_logprobs.append(d)
        if t.prompt_logprobs_done:
            del self._prompt_logprob_pending[request_id]

    def grammar_of(self, seq: Seq) -> GrammarState | None:
        t = self._live.get(seq.request.request_id)
        return None if t is None or t.grammars is None else t.grammars[seq.index]

    def take_released(self) -> list[int]:
        ids, self._released_seq_ids = self._released_seq_ids, []
        return ids

    def unrelease(self, seq_ids: list[int]) -> None:
        """A batch that carried `seq_ids` failed: the shards may never have seen them; they go with the next."""
        self._released_seq_ids[:0] = seq_ids

    def pop_stats(self) -> list[RequestStats]:
        out, self._finished_stats = self._finished_stats, []
        return out
