"""The engine API over one or more engine cores: `EngineAPI`, the base of `Engine` and `DPEngine`.

An engine is a list of ranks, each an `EngineCore` (scheduler + pages + requests, workers/core.py) with its
`KVConnector` beside it (workers/kv/), an `OutputProcessor` (token ids -> cumulative outputs) over all of them,
and something that executes every rank's batch. `Engine` (workers/engine.py) has one rank and an executor; `DPEngine` (workers/dp.py) one rank
per attention-dp rank over one worker group. A step is the same for both:

    for every rank: poll its transfers; if none started a request, schedule a batch; attach the rank's KV
                    commands to it (or, with no batch but transfers pending, make a KV-only batch of them)
    execute every rank's batch at once               (`_execute`, the subclass's)
    for every rank: update (token ids) -> outputs; queue the sends of what the step handed off; read the KV
                    events back (settled transfers, landed KV)
The disaggregation surface (admissions, outcomes, KV-only steps) is `EngineKV`'s (workers/engine_kv.py).

Outputs carry token ids, logprobs and finish reasons, no text: whoever shows text makes it (workers/text.py)
and reports a stop string back with `stop_sample`.

A step whose execute raises fails only the requests scheduled in it (their pages freed, each reported finished
with `RequestOutput.error`, a `StepFailedError`; a prefill's handoff reported failed); waiting requests and later
steps go on. Only an `ExecutorDeadError` (a worker group that lost a rank, a dead shard actor) stops the engine.

Not thread-safe: one thread drives an engine (the `AsyncEngine` step thread, or the `LLM` caller).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from msa.config import load_config
from workers.batch import StepBatch
from workers.config import EngineConfig, Role
from workers.core import EngineCore, EngineCoreOutput
from workers.engine_kv import EngineKV
from workers.executor import ExecutorDeadError
from workers.kv.config import TransferConfig
from workers.kv.connector import KVConnector
from workers.kv.roles import make_connector
from workers.memory import step_failure
from workers.output import OutputProcessor
from workers.request import RequestOutput, SamplingParams
from workers.runner import StepResult
from workers.stats import EngineStats, RequestStats, StepStats
from workers.structured import LazyCompiler, StructuredOutputCompiler
from workers.tokenizer import Tokenizer

logger = logging.getLogger("m3serve.engine")


def role_engine_config(config: EngineConfig, role: str) -> EngineConfig:
    """What a role's shards run with: a prefill engine never runs a decode step (it hands every request off
    after its first token), so it captures no decode CUDA graphs (startup time and graph memory saved)."""
    if role == "prefill" and not config.enforce_eager:
        return dataclasses.replace(config, enforce_eager=True)
    return config


@dataclass(frozen=True, slots=True)
class Rank:
    """One engine core and its KV connector (one dp rank, or the whole engine without dp)."""

    core: EngineCore
    kv: KVConnector


class EngineAPI(EngineKV):
    """The engine API (requests, the step, stats) over `self.ranks`, with `EngineKV`'s disaggregation surface;
    see the module docstring.
    Subclasses call `_setup` and `_add_rank`, and define `_execute` and `shutdown`."""

    def _setup(self, model_dir: str | Path, engine_config: EngineConfig, role: Role,
               transfer: TransferConfig | None) -> None:
        self.model_dir = Path(model_dir)
        self.role = role
        self.model_config = load_config(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        # The engine never schedules past what the model's positions cover.
        max_len = min(engine_config.max_model_len, self.model_config.max_position_embeddings)
        self.engine_config = dataclasses.replace(role_engine_config(engine_config, role), max_model_len=max_len)
        self.eos_token_ids = tuple(dict.fromkeys((*self.tokenizer.eos_token_ids, *self.model_config.eos_token_id)))
        self.transfer_config = transfer or TransferConfig()
        self.output = OutputProcessor()
        # structured outputs: one grammar compiler (and cache) for every core, built on the first constrained
        # request; masks are as wide as the lm_head
        self.grammars = LazyCompiler(lambda: StructuredOutputCompiler(self.tokenizer, self.model_config.vocab_size))
        self.ranks: list[Rank] = []
        self._step_stats: deque[StepStats] = deque(maxlen=4096)
        self.num_steps = 0
        # async scheduling: (batch, handle) of the launched step whose result is read next
        self._in_flight: tuple[StepBatch, object] | None = None
        self._parked: list[RequestOutput] = []  # outputs of a KV-only step run between steps (an abort's)

    def _add_rank(self, info: dict, agents: Sequence = (), *, seq_deltas: bool = True) -> Rank:
        """A core over a pool of `info["num_pages"]` pages, and its connector over `agents`. `seq_deltas`: False
        where the shard runs in this process (EngineCore)."""
        self.num_pages: int = info["num_pages"]  # per rank
        self.page_size: int = info["page_size"]
        if self.engine_config.async_scheduling is None:  # auto: on for a CUDA shard (EngineConfig)
            on_cuda = str(info.get("device", "")).startswith("cuda")
            self.engine_config = dataclasses.replace(self.engine_config, async_scheduling=on_cuda)
        core = EngineCore(self.engine_config, num_pages=self.num_pages, page_size=self.page_size,
                          eos_token_ids=self.eos_token_ids, vocab_size=self.model_config.vocab_size, role=self.role,
                          grammars=self.grammars, seq_deltas=seq_deltas)
        rank = Rank(core, make_connector(self.role, agents, self.transfer_config))
        self.ranks.append(rank)
        return rank

    def _execute(self, batches: list[StepBatch | None]) -> list[StepResult | None]:
        raise NotImplementedError

    def _launch(self, batch: StepBatch):
        """Async scheduling: start the one rank's step without waiting (a handle whose `result()` waits); only
        where `_runs_async()`."""
        raise NotImplementedError

    def _runs_async(self) -> bool:
        """Whether steps go through `_step_async`: `async_scheduling` on, one unified rank, and an executor that
        launches without waiting (the in-process one; Ray executors and dp stay synchronous)."""
        return False

    @property
    def cores(self) -> list[EngineCore]:
        return [r.core for r in self.ranks]

    # ---- requests ---------------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served (reads configuration only)."""
        self.ranks[0].core.validate(prompt_token_ids, params)

    def _add_to(self, rank: Rank, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                prompt: str | None, arrival_time: float | None, handoff_to: str | None,
                transfer_id: str | None) -> None:
        if handoff_to is not None and self.role != "prefill":
            raise ValueError(f"handoff_to: only a prefill engine hands requests off (this one is {self.role})")
        req = rank.core.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                    handoff=handoff_to is not None)
        if req.handoff:
            rank.kv.add_handoff(request_id, req.seqs[0].seq_id, transfer_id=transfer_id or request_id,
                                group=handoff_to)
        self.output.add(req, prompt)

    def _rank_of(self, request_id: str) -> Rank | None:
        return next((r for r in self.ranks if r.core.holds(request_id) or r.kv.holds(request_id)), None)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state and free its pages. False if it is unknown or already finished.
        Pages a KV transfer still reads or writes are freed once it settled (see `poll_transfers`)."""
        rank = self._rank_of(request_id)
        if rank is None:
            return False
        done = rank.kv.abort(rank.core, request_id)
        if done is None:
            done = rank.core.abort_request(request_id) is not None
        else:
            self._settle_now(rank)
        if not rank.core.holds(request_id):
            self.output.drop(request_id)
        return done

    def stop_sample(self, request_id: str, index: int, stop: str) -> list[RequestOutput]:
        """A stop string ended sample `index` (found in its text, outside the engine): finish it with reason
        "stop" (the request retires, its pages freed, once every sample finished). Returns the request's output
        now ([] when it is not running here: unknown, finished or aborted meanwhile; nothing changes then)."""
        rank = self._rank_of(request_id)
        if rank is None or not rank.core.holds(request_id) or rank.kv.holds(request_id):
            return []  # a request waiting on its KV has no tokens anyone could have read a stop string in
        rank.core.stop_sequence(request_id, index, stop)
        out = self.output.output(request_id)
        if out.finished:
            self.output.drop(request_id)
        return [out]

    def abort_all(self) -> int:
        """Abort every request in flight (shutdown). Returns how many."""
        n = 0
        for rank in self.ranks:
            ids = list(dict.fromkeys([*rank.core.request_ids(), *rank.kv.request_ids()]))
            for rid in ids:
                self.abort_request(rid)
            n += len(ids)
        return n

    def has_unfinished(self) -> bool:
        return self.has_runnable() or self.has_pending_transfers()

    def has_runnable(self) -> bool:
        """Requests a step can move on (not those only waiting on a KV transfer), KV commands waiting for a step,
        or a step launched ahead whose result the next step reads (async scheduling)."""
        return (self._in_flight is not None or bool(self._parked)
                or any(r.core.has_unfinished() or r.kv.wants_step() for r in self.ranks))

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the cumulative output of every request that progressed (finished ones last
        seen here with `.finished` set)."""
        if self._runs_async():
            return self._step_async()
        t0 = time.perf_counter()
        outputs, self._parked = self._parked, []
        batches: list[StepBatch | None] = []
        started: list[bool] = []  # per rank: requests started decoding from the last step's KV results
        for rank in self.ranks:
            polled = self._poll(rank) if rank.kv.has_pending() else []
            outputs += polled
            started.append(bool(polled))
            # requests that start decoding now: their first token goes out before this rank's next forward
            batches.append(None if polled else rank.core.schedule())
        scheduled = [r.core.scheduled for r in self.ranks]
        for rank in self.ranks:
            rank.kv.on_schedule(rank.core)
        # each rank's KV commands ride its batch; a rank with none but transfers to move gets a KV-only batch
        batches = [b if s else self._with_kv(rank, b) for rank, b, s in zip(self.ranks, batches, started, strict=True)]
        if all(b is None for b in batches):
            return outputs
        try:
            results = self._execute(batches)
        except BaseException as e:
            return outputs + self._fail_step(batches, e)
        for rank, batch, result in zip(self.ranks, batches, results, strict=True):
            if result is not None and rank.core.scheduled is not None:
                outputs += self._deliver(rank, rank.core.update(result))
            rank.kv.after_step(rank.core)
            if batch is not None and batch.kv is not None and result is not None:
                outputs += self._kv_events(rank, result.kv)
        if any(s is not None for s in scheduled):  # a KV-only step is no step of the model's
            self._record_step(t0, scheduled, results)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """One step with async scheduling (vLLM v1's is the model): with step n in flight, schedule and launch
        n+1 (its decode rows' inputs are n's sampled ids, taken on the device), then wait for n's tokens and
        update with them; n+1 is left running for the next call. Where the core cannot schedule ahead (a
        request whose rows need host tokens) the step is n alone, synchronous. A launch that raises fails its
        step after the step before it was updated."""
        t0 = time.perf_counter()
        rank = self.ranks[0]
        core = rank.core
        in_executor = 0.0  # seconds this thread spent in launch / result: the rest of the step is host work

        def launch(batch: StepBatch):
            nonlocal in_executor
            t = time.perf_counter()
            try:
                return batch, self._launch(batch)
            finally:
                in_executor += time.perf_counter() - t

        if self._in_flight is None:
            batch = core.schedule()
            if batch is None:
                return []
            rank.kv.on_schedule(core)
            try:
                self._in_flight = launch(batch)
            except BaseException as e:
                return self._fail_step([batch], e)
        ahead, launched, launch_error = None, None, None
        if core.can_schedule_ahead():
            ahead = core.schedule_ahead()
            if ahead is not None:
                try:
                    launched = launch(ahead)
                except BaseException as e:
                    launch_error = e
        scheduled = core.scheduled
        (batch, handle), self._in_flight = self._in_flight, launched
        outputs: list[RequestOutput] = []
        t = time.perf_counter()
        try:
            result = handle.result()
        except BaseException as e:
            outputs += self._fail_step([batch], e)
        else:
            in_executor += time.perf_counter() - t
            outputs += self._deliver(rank, core.update(result))
            rank.kv.after_step(core)
            self._record_step(t0, [scheduled], [result], in_executor=in_executor)
        if launch_error is not None:
            outputs += self._fail_step([ahead], launch_error)
        return outputs

    def _deliver(self, rank: Rank, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Token ids -> outputs; a finished request's transfer side goes on (a handoff's send)."""
        outputs = self.output.process(core_outputs)
        for out in outputs:
            if out.finished and rank.kv.holds(out.request_id):
                rank.kv.on_finished(rank.core, out)
        return outputs

    def _fail_step(self, batches: list[StepBatch | None], error: BaseException) -> list[RequestOutput]:
        """The execute raised: end exactly the requests of this step with the error (pages freed, a prefill's
        handoff reported failed) and return their outputs; everything else goes on (an `ExecutorDeadError`
        re-raised once every rank withdrew what it announced). The runner already released the device memory
        it could."""
        if not isinstance(error, Exception) or isinstance(error, ExecutorDeadError):
            for rank in self.ranks:
                rank.kv.after_step(rank.core)  # withdraws what was announced: its pairs wait for it
            raise error
        outputs: list[RequestOutput] = []
        for rank, batch in zip(self.ranks, batches):
            if batch is None or rank.core.scheduled is None:  # no batch, or a KV-only one
                continue
            rids = list(dict.fromkeys(c.seq.request.request_id for c in rank.core.scheduled.chunks))
            failure = step_failure(error, num_tokens=batch.num_tokens, num_requests=len(rids))
            logger.error("%s: failing requests %s", failure, rids, exc_info=error)
            for rid in rids:
                rank.kv.on_step_failed(rid, str(failure))
            failed = rank.core.fail_step("out_of_memory" if failure.out_of_memory else "step")
            for rid in dict.fromkeys(o.request_id for o in failed):
                out = self.output.output(rid)
                out.error = failure
                self.output.drop(rid)
                outputs.append(out)
            rank.kv.after_step(rank.core)
        return outputs

    def _record_step(self, t0: float, scheduled: list, results: list[StepResult | None], *,
                     in_executor: float | None = None) -> None:
        """One StepStats for the step: token counts summed over ranks; the forward is the slowest rank's (they
        run concurrently), everything else is host overhead. Async scheduling (`in_executor`): the step's time
        in the executor's launch and result calls is the forward's part, the rest host work, which on a GPU
        overlaps the device running the step launched ahead (on the CPU the launch runs the forward, so nothing
        overlaps there)."""
        step_time = time.perf_counter() - t0
        forward = (in_executor if in_executor is not None else
                   max((r.forward_time for r in results if r is not None), default=0.0))
        ran = [s for s in scheduled if s is not None]
        self._step_stats.append(StepStats(
            step_time=step_time, host_overhead=step_time - forward,
            num_prefill_tokens=sum(s.num_prefill_tokens for s in ran),
            num_decode_tokens=sum(s.num_decode_tokens for s in ran),
            batch_size=sum(len(s.chunks) for s in ran), num_preemptions=sum(len(s.preempted) for s in ran)))
        self.num_steps += 1

    # ---- stats ------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Summed over ranks (pages: the pools of all ranks together); requests whose pages are reserved while
        their KV arrives count as running."""
        parts = [_rank_stats(self.role, r) for r in self.ranks]
        if len(parts) == 1:
            return parts[0]
        summed = {f.name: sum(getattr(s, f.name) for s in parts)
                  for f in dataclasses.fields(EngineStats) if f.name != "role"}
        return EngineStats(role=self.role, **summed)

    def pop_request_stats(self) -> list[RequestStats]:
        return [s for r in self.ranks for s in r.core.pop_request_stats()]

    def pop_step_stats(self) -> list[StepStats]:
        out = list(self._step_stats)
        self._step_stats.clear()
        return out



def _rank_stats(role: str, rank: Rank) -> EngineStats:
    pm, sched = rank.core.pages, rank.core.scheduler
    return EngineStats(role=role, num_running=sched.num_running + rank.kv.num_awaiting_kv,
                       num_waiting=sched.num_waiting, num_pages_total=pm.num_pages,
                       num_pages_free=pm.num_free_pages, num_pages_cached=pm.num_cached_pages,
                       prefix_cache_queries=pm.prefix_queries, prefix_cache_hits=pm.prefix_hits,
                       num_preemptions=sched.num_preemptions)
