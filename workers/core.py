"""EngineCore: the scheduling half of one engine, pure Python over `Scheduler` and `PageManager`.

A step of an engine is three calls, and this module owns two of them:

    batch = core.schedule()           # StepBatch | None: what the executor runs now
    result = executor.execute(batch)  # not here: an executor runs the model (workers/executor/)
    outputs = core.update(result)     # list[EngineCoreOutput]: new token ids, their logprobs, finish reasons

The core holds no executor, no text and no KV agents, so it is unit-tested with a fake executor
(tests/workers/test_core.py) and composed as it is: `Engine` wraps one core, `DPEngine` one per dp rank around a
single execute. Text (detokenizing, stop strings) is made outside the engine (the ingress, the offline `LLM`),
and a stop-string hit comes back through `EngineAPI.stop_sample` as `stop_sequence`; KV transfer state lives beside it (`workers/kv/connector.py`).

Contract:
- `schedule()` returns None when nothing can run this step; else the batch for every chunk it picked. Exactly
  one `update(result)` or `fail_step(...)` must follow a batch before the next `schedule()`.
- `update(result)` applies the executor's result to the scheduled step: computed tokens are committed to the
  page manager, sampled tokens appended, every stop but stop strings checked. It returns one `EngineCoreOutput`
  per sequence that got a token, in the scheduler's order. A request whose every sample finished is retired:
  its pages are free (a prefill handoff's excepted: the scheduler keeps them for the transfer), its stats are
  closed (`pop_request_stats`), and its sequence ids reach the shards with the next batch (`released_seq_ids`).
- Page tables (and penalty rows' token ids) reach the shards as deltas (workers/batch_delta.py): the batches of
  one core must run on its shards in the order it scheduled them, and `fail_step` makes the next batch send its
  lists whole.
- Aborts (`abort_request`) free a request's pages in any state.
- The bookkeeping beside the scheduler (stats, prompt logprobs, grammar states, released sequence ids) is the
  core's `RequestTable` (workers/tracking.py).
- Async scheduling (`config.async_scheduling`): with one step scheduled and launched, `schedule_ahead()` (where
  `can_schedule_ahead()`) schedules the next one before the first's result is known (the scheduler's
  `advance`/`resolve`; docs/architecture.md); `update` / `fail_step` always apply to the oldest scheduled step.

Not thread-safe: the thread that steps the engine drives the core.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.batch import StepBatch, build_step_batch
from workers.batch_delta import SeqDeltaEncoder
from workers.config import EngineConfig
from workers.pages import PageManager
from workers.request import SamplingParams
from workers.scheduler import Request, Scheduler, SchedulerOutput, Sequence as Seq
from workers.stats import RequestStats
from workers.structured import GrammarError, GrammarState, LazyCompiler
from workers.tracking import RequestTable, Tracked, finished_reason

if TYPE_CHECKING:  # the result type only: the core never runs a model
    from workers.runner import StepResult


@dataclass(slots=True)  # not frozen: one is built per token, and a frozen dataclass builds ~2x slower
class EngineCoreOutput:
    """What one step did to one sequence (sample `index` of a request): the tokens it appended, their
    logprobs (None unless the request asked for logprobs; `{}` for a token whose logprobs did not come), and
    why it finished (None: it goes on). `prompt_logprobs`: the request's prompt logprobs once all are known."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class _Step:
    """A scheduled step until its update: `ahead` once `advance` accounted it before its tokens were known."""

    sched_out: SchedulerOutput
    batch: StepBatch
    ahead: bool = False


class EngineCore:
    """Scheduler + page manager + the requests in flight of one engine (or one dp rank); see the module
    docstring for the schedule/update contract."""

    def __init__(self, config: EngineConfig, *, num_pages: int, page_size: int, eos_token_ids: Sequence[int] = (),
                 vocab_size: int | None = None, role: str = "unified",
                 grammars: LazyCompiler | None = None, seq_deltas: bool = True) -> None:
        """`grammars`: the engine's structured-output compiler (shared by its cores); None refuses constrained
        requests. `seq_deltas`: batches carry what changed per sequence (workers/batch_delta.py), for shards in
        other processes; False (an in-process executor: nothing is pickled) sends the live tables as they are."""
        self.config = config
        self.grammars = grammars
        self.role = role
        self.eos_token_ids = tuple(eos_token_ids)
        self.pages = PageManager(num_pages, page_size, enable_prefix_caching=config.enable_prefix_caching,
                                 watermark=config.admission_watermark)
        self.scheduler = Scheduler(config, self.pages, eos_token_ids=self.eos_token_ids, vocab_size=vocab_size)
        self.requests = RequestTable(role)  # what the core keeps of each request beyond the scheduler's state
        # what the shards hold of each sequence's page table (and a penalty row's token ids): batches carry only
        # what changed (workers/batch_delta.py)
        self.seq_delta = SeqDeltaEncoder() if seq_deltas else None
        # steps scheduled and not yet updated, oldest first: one, or two while async scheduling runs one ahead
        self._steps: deque[_Step] = deque()

    # ---- requests ---------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served (reads configuration, and
        compiles a structured-output grammar into the shared cache: thread-safe, and off the step loop when the
        serving thread validates first)."""
        self.scheduler.validate([int(t) for t in prompt_token_ids], params)
        if params.structured is not None:
            self._compile(params)

    def _compile(self, params: SamplingParams):
        spec = params.structured
        if self.grammars is None:
            raise ValueError(f"{spec.source or 'structured'}: structured outputs are not enabled on this engine")
        try:
            return self.grammars.get().compile(spec)
        except GrammarError as e:
            # GrammarError is a ValueError; make sure the message leads with a field name (a 400 names it)
            raise GrammarError(str(e) if spec.source else f"structured: {e}") from None

    def _new_grammars(self, req: Request) -> list[GrammarState] | None:
        params = req.params
        if params.structured is None:
            return None
        self._compile(params)
        compiler = self.grammars.get()
        return [compiler.state(params.structured) for _ in req.seqs]

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    arrival_time: float | None = None, handoff: bool = False) -> Request:
        """Queue a request. `handoff` (prefill role): it ends after its first token with its pages kept."""
        if params.structured is not None:
            self._compile(params)  # a bad grammar raises before anything is queued
        req = self.scheduler.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                         handoff=handoff)
        self.requests.add(req, self._new_grammars(req))
        return req

    def add_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                   arrival_time: float | None = None) -> Request | None:
        """Decode role: reserve the pages of a prompt computed elsewhere; None when the pool has no room now.
        The request starts with `activate_remote`; `withdraw_remote` undoes an admission nobody started."""
        if params.structured is not None:
            self._compile(params)
        req = self.scheduler.add_remote(request_id, prompt_token_ids, params, arrival_time=arrival_time)
        if req is not None:
            self.requests.add(req, self._new_grammars(req))
        return req

    def withdraw_remote(self, request_id: str) -> None:
        """Undo `add_remote` (its KV cannot be prepared): pages freed, no stats recorded."""
        self.scheduler.abort(request_id)
        self.requests.drop(request_id)

    def activate_remote(self, request_id: str, first_token: int,
                        first_logprobs: dict[int, float] | None) -> list[EngineCoreOutput]:
        """Decode role: the prompt's KV landed and its first token is known; it decodes from the next step."""
        t = self.requests[request_id]
        seq = self.scheduler.activate_remote(request_id, first_token)
        self._advance_grammar(t, seq, first_token)  # the prefill engine sampled it under the same grammar
        out = _token_output(t, seq, first_token, first_logprobs, time.monotonic())
        if t.req.finished:
            self.requests.retire(t)
        return [out]

    def abort_request(self, request_id: str, *, reason: str = "abort",
                      failure_reason: str | None = None) -> Request | None:
        """End a request in any state, freeing its pages; its sequences finish with `reason` ("abort", or
        "error" for a failed step). `failure_reason` (e.g. "transfer") marks its stats as failed. Returns the
        request, None if unknown or finished."""
        req = self.scheduler.abort(request_id, reason=reason)
        t = self.requests.drop(request_id)
        if req is None:
            return None
        if t is not None:
            t.stats.failure_reason = failure_reason
        self.requests.ended(req, t, "abort" if failure_reason is None else "error")
        return req

    def stop_sequence(self, request_id: str, index: int, stop: str) -> None:
        """A stop string ended sample `index` (whoever makes the text found it, between steps): finish it with
        reason "stop". A sample a length limit (or a handoff) ended in the latest step takes the stop instead."""
        t, retired = self.requests.live_or_retired_now(request_id)
        if t is None:
            return
        seq = t.req.seqs[index]
        if seq.finished:
            seq.finish_reason, seq.stop_reason = "stop", stop
            if retired:
                t.stats.finished_reason = finished_reason(t.req)
            return
        self.scheduler.finish(seq, "stop", stop)
        if t.req.finished:
            self.requests.retire(t)

    def holds(self, request_id: str) -> bool:
        """Whether the request is in flight here (queued, running, or awaiting its KV)."""
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        return self.requests.ids()

    def has_unfinished(self) -> bool:
        """Requests a step can move on (queued or running; not those waiting on a KV transfer)."""
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------------
    def schedule(self) -> StepBatch | None:
        """Pick this step's chunks; the batch the executor runs, None when nothing runs this step."""
        assert not self._steps, "schedule() twice without update() (schedule_ahead runs one step ahead)"
        return self._schedule(pending_rows=None)

    def can_schedule_ahead(self) -> bool:
        """Whether `schedule_ahead` may run now: async scheduling on, a unified engine (a KV handoff or a remote
        decode is synchronous), exactly one step in flight, and no request whose rows need host tokens."""
        return (self.config.async_scheduling and self.role == "unified" and len(self._steps) == 1
                and not self._steps[0].ahead and not self.requests.any_needs_host_tokens)

    def schedule_ahead(self) -> StepBatch | None:
        """Async scheduling: the next step's batch while the one in flight still runs (`can_schedule_ahead`).
        The step in flight is accounted as done, each of its sampling sequences assumed to get one token; the
        new batch's rows that follow such a sequence take their input id on the device from the step in
        flight's sampled ids (`StepBatch.deferred_*`). `update` then takes the older step's result first."""
        assert self.can_schedule_ahead(), "schedule_ahead() without exactly one plain step in flight"
        step = self._steps[0]
        self.scheduler.advance(step.sched_out)
        step.ahead = True
        rows = {step.sched_out.chunks[ci].seq.seq_id: r for r, ci in enumerate(step.batch.sample_chunks)}
        return self._schedule(pending_rows=rows)

    def _schedule(self, pending_rows: dict[int, int] | None) -> StepBatch | None:
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if self.scheduler.has_unfinished() and not sched_out.preempted and not self._steps:
                raise RuntimeError("scheduler: requests are queued but none could be scheduled")
            return None
        batch = build_step_batch(sched_out, self.pages, eos_token_ids=self.eos_token_ids,
                                 released_seq_ids=self.requests.take_released(),
                                 prompt_logprob_progress=self.requests.prompt_logprob_progress(),
                                 grammar_of=self.requests.grammar_of, pending_rows=pending_rows,
                                 seq_delta=self.seq_delta)
        self._steps.append(_Step(sched_out, batch))
        return batch

    @property
    def scheduled(self) -> SchedulerOutput | None:
        """The oldest step between `schedule()` and its `update()` / `fail_step()` (None outside one)."""
        return self._steps[0].sched_out if self._steps else None

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._steps)

    def update(self, result: StepResult) -> list[EngineCoreOutput]:
        """Apply the executor's result to the oldest scheduled step (see the module docstring)."""
        step = self._take_scheduled()
        sched_out, batch = step.sched_out, step.batch
        self.requests.begin_update()
        for pc, dicts in zip(batch.prompt_logprob_chunks, result.prompt_logprobs, strict=True):
            self.requests.on_prompt_logprobs(sched_out.chunks[pc.chunk_index].seq.request.request_id, pc.start, dicts)
        sampled: list[int | None] = [None] * len(sched_out.chunks)
        row_of_seq: dict[int, int] = {}
        for r, (ci, tok) in enumerate(zip(batch.sample_chunks, result.token_ids, strict=True)):
            sampled[ci] = tok
            row_of_seq[sched_out.chunks[ci].seq.seq_id] = r
        if step.ahead:
            update = self.scheduler.resolve(sched_out, sampled)
        else:
            update = self.scheduler.update(sched_out, sampled)
        now = time.monotonic()
        outputs = []
        for seq, token in update.new_tokens:
            t = self.requests[seq.request.request_id]
            self._advance_grammar(t, seq, token)
            outputs.append(_token_output(t, seq, token, result.logprobs[row_of_seq[seq.seq_id]], now))
        ended = [seq for seq, _ in update.new_tokens if seq.finished] + update.finished
        for rid in dict.fromkeys(seq.request.request_id for seq in ended if seq.request.finished):
            t = self.requests.get(rid)
            if t is not None:
                self.requests.retire(t)
        return outputs

    def _advance_grammar(self, t: Tracked, seq: Seq, token: int) -> None:
        """Feed a constrained sequence's new token to its grammar; the grammar's end (EOS accepted) finishes it
        with "stop" even where the scheduler would not (ignore_eos, min_tokens). A token the grammar refuses
        cannot come from the masked sampler: if one does, the sequence ends with "error" rather than go on
        unconstrained."""
        if t.grammars is None:
            return
        state = t.grammars[seq.index]
        if state.is_terminated():
            return
        if not state.accept(token):
            self.scheduler.finish(seq, "error", None)
        elif state.is_terminated():
            self.scheduler.finish(seq, "stop", None)

    def fail_step(self, failure_reason: str) -> list[EngineCoreOutput]:
        """The executor raised on the scheduled step: end exactly its requests (pages freed, sequences finished
        with "error", stats failed with `failure_reason`); one output per sample of each."""
        step = self._take_scheduled()
        sched_out, batch = step.sched_out, step.batch
        self.requests.unrelease(batch.released_seq_ids)  # in case the shard never saw them
        if self.seq_delta is not None:
            self.seq_delta.reset()  # nor this batch's delta: the next batch sends its lists whole
        outputs = []
        for rid in dict.fromkeys(c.seq.request.request_id for c in sched_out.chunks):
            req = self.abort_request(rid, reason="error", failure_reason=failure_reason)
            if req is None:
                continue
            outputs.extend(EngineCoreOutput(rid, s.index, [], None, s.finish_reason, s.stop_reason)
                           for s in req.seqs)
        return outputs

    def _take_scheduled(self) -> _Step:
        if not self._steps:
            raise RuntimeError("update: no step is scheduled")
        return self._steps.popleft()

    def pop_request_stats(self) -> list[RequestStats]:
        return self.requests.pop_stats()

    # ---- pages ------------------------------------------------------------------------------------------
    def free_pages(self, seq_id: int) -> None:
        """Free the pages a finished sequence kept (a prefill handoff's, once its transfer settled)."""
        self.pages.free(seq_id)


def _token_output(t: Tracked, seq: Seq, token: int, logprobs: dict[int, float] | None,
                  now: float) -> EngineCoreOutput:
    """Sequence `seq` of `t` got `token` at `now`: its timing recorded, what the step did to it."""
    t.record_token(now)
    wants_logprobs = t.req.params.logprobs is not None
    return EngineCoreOutput(t.req.request_id, seq.index, [token], [logprobs or {}] if wants_logprobs else None,
                            seq.finish_reason, seq.stop_reason,
                            list(t.prompt_logprobs) if t.prompt_logprobs_done else None)

