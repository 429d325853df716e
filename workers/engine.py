"""The engine of one model instance: scheduler + page manager + the shard(s) that run the model.

A step is schedule -> execute -> update:
  schedule: the scheduler picks chunks (continuous batching, chunked prefill, preemption);
  execute:  the shard builds attention metadata, runs the forward and samples (in-process for one shard, or a
            `ShardWorker` Ray actor);
  update:   tokens are appended, stops checked (stop strings here, on detokenized text), outputs built.
Everything outside the forward is host overhead; each step's is measured and kept in `StepStats`.

Not thread-safe: one thread drives an Engine (the `AsyncEngine` step thread, or the `LLM` caller).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from msa.config import load_config
from workers.batch import StepBatch, build_step_batch
from workers.config import EngineConfig, ParallelConfig, Role
from workers.pages import PageManager
from workers.request import CompletionOutput, RequestOutput, SamplingParams
from workers.runner import StepResult
from workers.scheduler import Request, Scheduler, Sequence as Seq
from workers.stats import EngineStats, RequestStats, StepStats
from workers.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string, stop_holdback

ExecutorKind = Literal["auto", "local", "ray"]


class Executor(Protocol):
    """Runs steps on the instance's shard(s)."""

    def info(self) -> dict: ...

    def execute(self, batch: StepBatch) -> StepResult: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One shard in this process (tp = ep = dp = 1): no RPC on the step path."""

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, device: str) -> None:
        from workers.runner import ModelRunner

        self.runner = ModelRunner(model_dir, engine_config=engine_config, device=device)

    def info(self) -> dict:
        return self.runner.info()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.runner.execute(batch)

    def shutdown(self) -> None:
        self.runner = None


def make_executor(kind: ExecutorKind, model_dir, *, engine_config: EngineConfig, parallel: ParallelConfig,
                  device: str) -> Executor:
    if parallel.world_size > 1 or parallel.ep > 1:
        raise NotImplementedError("parallel: tp/ep/dp > 1 needs the multi-shard worker group (issue 5)")
    if kind in ("auto", "local"):
        return LocalExecutor(model_dir, engine_config=engine_config, device=device)
    if kind == "ray":
        from workers.shard import RayExecutor

        return RayExecutor(model_dir, engine_config=engine_config, device=device)
    raise ValueError(f"executor: unknown kind {kind!r} (auto | local | ray)")


@dataclass(eq=False)
class _Tracked:
    """Engine-side state of one request: text, logprobs and stats per sample."""

    req: Request
    prompt: str | None
    detoks: list[IncrementalDetokenizer]
    texts: list[str]
    logprobs: list[list[dict[int, float]] | None]
    stopped_by_string: list[bool]
    stats: RequestStats
    holdback: int
    token_times: list[float] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # position 0 is None (nothing predicts it)

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.req.prompt_token_ids)


class Engine:
    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig = EngineConfig(),
                 parallel: ParallelConfig = ParallelConfig(), device: str = "cpu", role: Role = "unified",
                 executor: ExecutorKind = "auto") -> None:
        self.model_dir = Path(model_dir)
        self.role = role
        self.model_config = load_config(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        # The engine never schedules past what the model's positions cover.
        max_len = min(engine_config.max_model_len, self.model_config.max_position_embeddings)
        self.engine_config = dataclasses.replace(engine_config, max_model_len=max_len)
        self.executor = make_executor(executor, model_dir, engine_config=self.engine_config, parallel=parallel,
                                      device=device)
        info = self.executor.info()
        self.num_pages: int = info["num_pages"]
        self.page_size: int = info["page_size"]
        self.pages = PageManager(self.num_pages, self.page_size,
                                 enable_prefix_caching=self.engine_config.enable_prefix_caching,
                                 watermark=self.engine_config.admission_watermark)
        self.eos_token_ids = tuple(dict.fromkeys((*self.tokenizer.eos_token_ids, *self.model_config.eos_token_id)))
        self.scheduler = Scheduler(self.engine_config, self.pages, eos_token_ids=self.eos_token_ids,
                                   vocab_size=self.model_config.vocab_size)
        self._tracked: dict[str, _Tracked] = {}
        self._prompt_logprob_pending: dict[str, _Tracked] = {}
        self._released_seq_ids: list[int] = []
        self._finished_stats: list[RequestStats] = []
        self._step_stats: deque[StepStats] = deque(maxlen=4096)
        self.num_steps = 0

    # ---- requests ---------------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served (reads configuration only)."""
        self.scheduler.validate([int(t) for t in prompt_token_ids], params)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        req = self.scheduler.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time)
        n = params.n
        self._tracked[request_id] = _Tracked(
            req=req, prompt=prompt,
            detoks=[IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
                    for _ in range(n)],
            texts=[""] * n,
            logprobs=[[] if params.logprobs is not None else None for _ in range(n)],
            stopped_by_string=[False] * n,
            stats=RequestStats(request_id=request_id, role=self.role, prompt_tokens=len(req.prompt_token_ids),
                               arrival_time=req.arrival_time),
            holdback=stop_holdback(params.stop),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.prompt_logprobs is not None and len(req.prompt_token_ids) > 1:
            self._prompt_logprob_pending[request_id] = self._tracked[request_id]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request in any state and free its pages. False if it is unknown or already finished."""
        req = self.scheduler.abort(request_id)
        tracked = self._tracked.pop(request_id, None)
        self._prompt_logprob_pending.pop(request_id, None)
        if req is None:
            return False
        self._released_seq_ids.extend(s.seq_id for s in req.seqs)
        if tracked is not None:
            self._close_stats(tracked, "abort")
        return True

    def abort_all(self) -> int:
        """Abort every request in flight (shutdown). Returns how many."""
        ids = list(self._tracked)
        for rid in ids:
            self.abort_request(rid)
        return len(ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the cumulative output of every request that progressed (finished ones last
        seen here with `.finished` set)."""
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if self.scheduler.has_unfinished() and not sched_out.preempted:
                raise RuntimeError("scheduler: requests are queued but none could be scheduled")
            return []
        progress = {t.req.seqs[0].seq_id: len(t.prompt_logprobs) for t in self._prompt_logprob_pending.values()}
        batch = build_step_batch(sched_out, self.pages, eos_token_ids=self.eos_token_ids,
                                 released_seq_ids=self._released_seq_ids, prompt_logprob_progress=progress)
        self._released_seq_ids = []
        result = self.executor.execute(batch)
        for pc, dicts in zip(batch.prompt_logprob_chunks, result.prompt_logprobs, strict=True):
            self._on_prompt_logprobs(sched_out.chunks[pc.chunk_index].seq.request.request_id, pc.start, dicts)
        sampled: list[int | None] = [None] * len(sched_out.chunks)
        row_of_seq: dict[int, int] = {}
        for r, (ci, tok) in enumerate(zip(batch.sample_chunks, result.token_ids, strict=True)):
            sampled[ci] = tok
            row_of_seq[sched_out.chunks[ci].seq.seq_id] = r
        update = self.scheduler.update(sched_out, sampled)
        now = time.monotonic()
        touched: dict[str, _Tracked] = {}
        for seq, token in update.new_tokens:
            t = self._tracked[seq.request.request_id]
            touched[seq.request.request_id] = t
            self._on_token(t, seq, token, result.logprobs[row_of_seq[seq.seq_id]], now)
        outputs = [self._output(t) for t in touched.values()]
        for t in touched.values():
            if t.req.finished:
                self._released_seq_ids.extend(s.seq_id for s in t.req.seqs)
                del self._tracked[t.req.request_id]
                self._prompt_logprob_pending.pop(t.req.request_id, None)
                self._close_stats(t, None)
        self.num_steps += 1
        step_time = time.perf_counter() - t0
        self._step_stats.append(StepStats(
            step_time=step_time, host_overhead=step_time - result.forward_time,
            num_prefill_tokens=sched_out.num_prefill_tokens, num_decode_tokens=sched_out.num_decode_tokens,
            batch_size=len(sched_out.chunks), num_preemptions=len(sched_out.preempted)))
        return outputs

    def _on_prompt_logprobs(self, request_id: str, start: int, dicts: list[dict[int, float]]) -> None:
        t = self._prompt_logprob_pending.get(request_id)
        if t is None:
            return
        for j, d in enumerate(dicts):
            if start + 1 + j == len(t.prompt_logprobs):  # in order, each position once (recompute repeats some)
                t.prompt_logprobs.append(d)
        if t.prompt_logprobs_done:
            del self._prompt_logprob_pending[request_id]

    def _on_token(self, t: _Tracked, seq: Seq, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        i = seq.index
        if t.stats.first_token_time is None:
            t.stats.first_token_time = now
        t.token_times.append(now)
        if t.logprobs[i] is not None:
            t.logprobs[i].append(logprobs or {})
        delta = t.detoks[i].add([token])
        params = t.req.params
        if delta:
            start = len(t.texts[i])
            t.texts[i] += delta
            if params.stop and seq.finish_reason != "stop":  # an EOS / stop id already ended it
                hit = find_stop_string(t.texts[i], params.stop, start)
                if hit is not None:
                    idx, stop = hit
                    t.texts[i] = t.texts[i][:idx + len(stop) if params.include_stop_str_in_output else idx]
                    t.stopped_by_string[i] = True
                    if seq.finished:  # it also hit a length limit this step: the stop string wins
                        seq.finish_reason, seq.stop_reason = "stop", stop
                    else:
                        self.scheduler.finish(seq, "stop", stop)
        if seq.finished and not t.stopped_by_string[i]:
            t.texts[i] += t.detoks[i].flush()

    def _output(self, t: _Tracked) -> RequestOutput:
        req = t.req
        outs = []
        for seq in req.seqs:
            i = seq.index
            text = t.texts[i]
            if t.holdback and seq.finish_reason is None:
                # Never show the start of a stop string a later token may complete (the text would shrink).
                text = text[:max(len(text) - t.holdback, 0)]
            outs.append(CompletionOutput(index=i, token_ids=seq.output_token_ids, text=text,
                                         logprobs=list(t.logprobs[i]) if t.logprobs[i] is not None else None,
                                         finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(request_id=req.request_id, prompt=t.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=req.finished,
                             prompt_logprobs=list(t.prompt_logprobs) if t.prompt_logprobs_done else None)

    def _close_stats(self, t: _Tracked, reason: str | None) -> None:
        s = t.stats
        req = t.req
        s.generation_tokens = sum(q.num_output_tokens for q in req.seqs)
        reasons = [q.finish_reason for q in req.seqs]
        s.finished_reason = reason or ("stop" if "stop" in reasons else reasons[0])
        s.finished_time = time.monotonic()
        s.token_times = t.token_times
        s.num_preemptions = sum(q.num_preemptions for q in req.seqs)
        s.prefix_cache_hit_tokens = req.prefix_cache_hit_tokens
        s.first_scheduled_time = req.first_scheduled_time
        self._finished_stats.append(s)

    # ---- stats ------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pm = self.pages
        return EngineStats(role=self.role, num_running=self.scheduler.num_running,
                           num_waiting=self.scheduler.num_waiting, num_pages_total=pm.num_pages,
                           num_pages_free=pm.num_free_pages, num_pages_cached=pm.num_cached_pages,
                           prefix_cache_queries=pm.prefix_queries, prefix_cache_hits=pm.prefix_hits,
                           num_preemptions=self.scheduler.num_preemptions)

    def pop_request_stats(self) -> list[RequestStats]:
        out, self._finished_stats = self._finished_stats, []
        return out

    def pop_step_stats(self) -> list[StepStats]:
        out = list(self._step_stats)
        self._step_stats.clear()
        return out

    def shutdown(self) -> None:
        self.executor.shutdown()
