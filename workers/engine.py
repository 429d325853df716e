"""The engine of one model instance: scheduler + page manager + the shard(s) that run the model.

A step is schedule -> execute -> update:
  schedule: the scheduler picks chunks (continuous batching, chunked prefill, preemption);
  execute:  the shard builds attention metadata, runs the forward and samples (in-process for one shard, or a
            `ShardWorker` Ray actor);
  update:   tokens are appended, stops checked (stop strings here, on detokenized text), outputs built.
Everything outside the forward is host overhead; each step's is measured and kept in `StepStats`.

Roles (docs/disaggregation.md): "unified" runs requests start to end. "prefill" runs a request's prompt and
samples its first token; a request added with `handoff_to=<decode group>` then keeps its pages, sends them to
that decode group (`TransferAgent`, one per shard) and frees them once the transfer settled (or its lease
expired). "decode" reserves a request's pages first (`admit_remote`), receives the prompt's KV into them, and
decodes from there as soon as they landed: the first token rides in the KV header (or, for a retried prefill,
comes through `continue_remote`). `poll_transfers` (called by `step`) moves those requests on; it never blocks.

A step whose execute raises fails only the requests scheduled in it (their pages freed, each reported finished
with `RequestOutput.error`, a `StepFailedError`; a prefill's handoff reported failed); waiting requests and later
steps go on. Only an `ExecutorDeadError` (a worker group that lost a rank, a dead shard actor) stops the engine.

Not thread-safe: one thread drives an Engine (the `AsyncEngine` step thread, or the `LLM` caller).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from msa.config import load_config
from workers.batch import StepBatch, build_step_batch
from workers.config import EngineConfig, ParallelConfig, Role
from workers.executor import ExecutorDeadError, ExecutorKind, make_executor
from workers.memory import step_failure
from workers.pages import PageManager
from workers.request import CompletionOutput, RequestOutput, SamplingParams
from workers.scheduler import Request, Scheduler, Sequence as Seq
from workers.stats import EngineStats, RequestStats, StepStats
from workers.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string, stop_holdback
from workers.stats import TransferStats
from workers.kv.agent import TransferAgent
from workers.kv.config import TransferConfig, TransferState
from workers.kv.endpoint import TransferResult

logger = logging.getLogger("m3serve.engine")


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


def first_token_meta(token: int, logprobs: dict[int, float] | None) -> dict:
    """The prefill's first token as it rides in the KV header (JSON: logprobs as [id, value] pairs, so ids stay
    ints; floats survive JSON exactly)."""
    return {"first": int(token), "logprobs": None if logprobs is None else [[int(k), v] for k, v in logprobs.items()]}


def first_token_from_meta(meta: dict) -> tuple[int, dict[int, float] | None] | None:
    """(token, logprobs) from a KV header's meta; None when it carries no first token."""
    if "first" not in meta:
        return None
    lp = meta.get("logprobs")
    return int(meta["first"]), None if lp is None else {int(k): float(v) for k, v in lp}


class KVTransferFailed(RuntimeError):
    """A disaggregated request lost its KV on the way (transfer error, dead peer, lease expired)."""


@dataclass(eq=False, kw_only=True)
class _Handoff:
    """Prefill engine: a request whose pages go to a decode group once its first token exists."""

    seq_id: int
    transfer_id: str
    group: str
    created: float
    sent: bool = False
    aborted: bool = False


@dataclass(eq=False, kw_only=True)
class _Remote:
    """Decode engine: a request whose pages are reserved and whose prompt KV comes from a prefill engine."""

    transfer_id: str
    created: float
    first: tuple[int, dict[int, float] | None] | None = None  # the first token and its logprobs, from prefill
    # take the first token from the KV header (the prefill's sample travels with its pages), so decoding starts
    # when the pages land; False: wait for `continue_remote` (a retried prefill: the client has another token)
    first_from_kv: bool = True
    landed: bool = False
    aborted: bool = False  # by the client, or failed: the pages go once the transfer settled
    failure: str | None = None


def role_engine_config(config: EngineConfig, role: str) -> EngineConfig:
    """What a role's shards run with: a prefill engine never runs a decode step (it hands every request off
    after its first token), so it captures no decode CUDA graphs (startup time and graph memory saved)."""
    if role == "prefill" and not config.enforce_eager:
        return dataclasses.replace(config, enforce_eager=True)
    return config


class Engine:
    def __new__(cls, *args, parallel: ParallelConfig = ParallelConfig(), **kwargs):
        # dp > 1 (attention data parallel): one engine core per dp rank over one worker group (workers/dp.py)
        if cls is Engine and parallel.dp > 1:
            from workers.dp import DPEngine

            return super().__new__(DPEngine)
        return super().__new__(cls)

    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig = EngineConfig(),
                 parallel: ParallelConfig = ParallelConfig(), device: str = "cpu", role: Role = "unified",
                 executor: ExecutorKind = "auto", transfer: TransferConfig | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.role = role
        self.model_config = load_config(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        # The engine never schedules past what the model's positions cover.
        max_len = min(engine_config.max_model_len, self.model_config.max_position_embeddings)
        self.engine_config = dataclasses.replace(role_engine_config(engine_config, role), max_model_len=max_len)
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
        # Handoff marks of disaggregated requests for `AsyncEngine.debug_timeline` (bounded; step thread only)
        self.marks: deque[tuple] = deque(maxlen=_MAX_MARKS)
        # disaggregation
        self.transfer_config = transfer or TransferConfig()
        self.agents: list[TransferAgent] = []
        if role in ("prefill", "decode"):
            make_agents = getattr(self.executor, "transfer_agents", None)
            if make_agents is None:
                raise NotImplementedError(f"role: {role!r} needs shards with KV transfer agents "
                                          f"({type(self.executor).__name__} has none yet)")
            self.agents = make_agents(role, self.model_config.num_key_value_heads, self.transfer_config)
        self._handoffs: dict[str, _Handoff] = {}
        self._to_send: list[tuple[str, list[int], dict]] = []  # handed off in this step: (request id, pages, meta)
        # announced before this step's forward (TransferConfig.announce): request id -> (transfer id, group)
        self._announced: dict[str, tuple[str, str]] = {}
        # announced, then ended by their first token: transfer id -> (group, seq id whose pages it reads, or None)
        self._to_withdraw: dict[str, tuple[str, int | None]] = {}
        self._withdrawn: dict[str, tuple[int | None, float]] = {}  # sent withdrawn: transfer id -> (seq id, when)
        self._remote: dict[str, _Remote] = {}
        # decode: prefill group -> its per-prefill-dp-rank sub-groups (a prefill with attention DP, kv_listen)
        self._split: dict[str, list[str]] = {}
        self._failures: list[tuple[str, str]] = []  # (request id, reason): decode requests that lost their KV
        self._outcomes: list[tuple[str, bool, str | None]] = []  # prefill: (request id, transfer ok, reason)
        self._transfer_stats: list[TransferStats] = []

    # ---- requests ---------------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field if the request can never be served (reads configuration only)."""
        self.scheduler.validate([int(t) for t in prompt_token_ids], params)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time: float | None = None, handoff_to: str | None = None,
                    transfer_id: str | None = None) -> None:
        """`handoff_to` (prefill role): the decode group that receives the request's KV after its first token
        (under `transfer_id`, default the request id; the decode engine must have admitted it already)."""
        if handoff_to is not None and self.role != "prefill":
            raise ValueError(f"handoff_to: only a prefill engine hands requests off (this one is {self.role})")
        req = self.scheduler.add_request(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                         handoff=handoff_to is not None)
        if req.handoff:
            self._handoffs[request_id] = _Handoff(seq_id=req.seqs[0].seq_id, transfer_id=transfer_id or request_id,
                                                  group=handoff_to, created=time.monotonic())
        self._track(req, prompt)

    def _track(self, req: Request, prompt: str | None) -> None:
        request_id, params = req.request_id, req.params
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
        """Stop a request in any state and free its pages. False if it is unknown or already finished.
        Pages a KV transfer still reads or writes are freed once it settled (see `poll_transfers`)."""
        if request_id in self._remote:
            return self._abort_remote(request_id)
        handoff = self._handoffs.get(request_id)
        if handoff is not None and handoff.sent:
            handoff.aborted = True
            for agent in self.agents:
                agent.abort(handoff.transfer_id)
            return True
        if self._handoffs.pop(request_id, None) is not None:
            self._outcomes.append((request_id, False, "aborted"))
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
        ids = list(dict.fromkeys([*self._tracked, *self._remote, *self._handoffs]))
        for rid in ids:
            self.abort_request(rid)
        return len(ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.has_pending_transfers()

    def hands_off(self, request_id: str) -> bool:
        """Prefill role: whether `request_id` will send (or is sending) its KV to a decode group."""
        return request_id in self._handoffs

    def has_pending_transfers(self) -> bool:
        """Requests waiting on a KV transfer (or its lease) rather than on a step."""
        return bool(self._handoffs or self._remote or self._withdrawn)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the cumulative output of every request that progressed (finished ones last
        seen here with `.finished` set)."""
        t0 = time.perf_counter()
        polled = self.poll_transfers() if self.has_pending_transfers() else []
        if polled:  # requests that start decoding now: their first token goes out before this step's forward
            return polled
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if self.scheduler.has_unfinished() and not sched_out.preempted:
                raise RuntimeError("scheduler: requests are queued but none could be scheduled")
            return polled
        progress = {t.req.seqs[0].seq_id: len(t.prompt_logprobs) for t in self._prompt_logprob_pending.values()}
        batch = build_step_batch(sched_out, self.pages, eos_token_ids=self.eos_token_ids,
                                 released_seq_ids=self._released_seq_ids, prompt_logprob_progress=progress)
        self._released_seq_ids = []
        self._announce(sched_out)
        try:
            result = self.executor.execute(batch)
        except BaseException as e:
            recoverable = isinstance(e, Exception) and not isinstance(e, ExecutorDeadError)
            failed = self._fail_step(sched_out, batch, e) if recoverable else None
            self._send_handoffs()  # withdraws what was announced: its pairs wait for it
            if failed is None:
                raise
            return failed
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
                self._retire(t)
        self._send_handoffs()
        self.num_steps += 1
        step_time = time.perf_counter() - t0
        self._step_stats.append(StepStats(
            step_time=step_time, host_overhead=step_time - result.forward_time,
            num_prefill_tokens=sched_out.num_prefill_tokens, num_decode_tokens=sched_out.num_decode_tokens,
            batch_size=len(sched_out.chunks), num_preemptions=len(sched_out.preempted)))
        return polled + outputs

    def _fail_step(self, sched_out, batch: StepBatch, error: Exception) -> list[RequestOutput]:
        """The executor raised: end exactly the requests of this step with the error (pages freed, a prefill's
        handoff reported failed) and return their outputs; everything else goes on. (The runner already released
        the device memory it could.)"""
        rids = list(dict.fromkeys(c.seq.request.request_id for c in sched_out.chunks))
        failure = step_failure(error, num_tokens=batch.num_tokens, num_requests=len(rids))
        logger.error("%s: failing requests %s", failure, rids, exc_info=error)
        self._released_seq_ids[:0] = batch.released_seq_ids  # in case the shard never saw them
        outputs = []
        for rid in rids:
            t = self._tracked.pop(rid)
            self._prompt_logprob_pending.pop(rid, None)
            if self._handoffs.pop(rid, None) is not None:
                self._outcomes.append((rid, False, str(failure)))
            req = self.scheduler.abort(rid, reason="error")
            self._released_seq_ids.extend(q.seq_id for q in req.seqs)
            t.stats.failure_reason = "out_of_memory" if failure.out_of_memory else "step"
            self._close_stats(t, "error")
            out = self._output(t)
            out.error = failure
            outputs.append(out)
        return outputs

    def _retire(self, t: _Tracked) -> None:
        """A request finished on this engine: drop its state; a prefill hands its pages to the transfer."""
        req = t.req
        self._released_seq_ids.extend(s.seq_id for s in req.seqs)
        del self._tracked[req.request_id]
        self._prompt_logprob_pending.pop(req.request_id, None)
        self._close_stats(t, None)
        handoff = self._handoffs.get(req.request_id)
        if handoff is None:
            return
        seq = req.seqs[0]
        if seq.finish_reason != "handoff":  # the first token ended it (stop string): nothing to send
            del self._handoffs[req.request_id]
            announced = self._announced.pop(req.request_id, None)
            if announced is None:
                self.pages.free(seq.seq_id)
            else:  # its header went ahead: its bytes still go (withdrawn), read from its pages until settled
                self._to_withdraw[announced[0]] = (announced[1], seq.seq_id)
            return
        page_ids = self.pages.page_table(seq.seq_id)[:self.pages.pages_for(seq.num_prompt_tokens)]
        meta = first_token_meta(seq.output_token_ids[0], t.logprobs[0][0] if t.logprobs[0] else None)
        self._to_send.append((req.request_id, page_ids, meta))

    def _announce(self, sched_out) -> None:
        """Prefill: the requests whose prompt completes in this step (their first token is sampled in it) have
        their KV header sent now, before the forward, so the decode side posts its receives while this step
        computes (`TransferConfig.announce`; agents without `announce` (worker groups) send after the step)."""
        if self.role != "prefill" or not self.transfer_config.announce or not self._handoffs:
            return
        if not all(hasattr(agent, "announce") for agent in self.agents):
            return
        by_group: dict[str, list] = {}
        for c in sched_out.chunks:
            h = self._handoffs.get(c.seq.request.request_id) if c.sample and not c.is_decode else None
            if h is None or h.sent:
                continue
            ids = self.pages.page_table(c.seq.seq_id)[:self.pages.pages_for(c.seq.num_prompt_tokens)]
            by_group.setdefault(h.group, []).append((c.seq.request.request_id, h.transfer_id, list(ids)))
        for group, items in by_group.items():
            try:  # an engine has one agent (a group's spans its shards)
                for agent in self.agents:
                    agent.announce([(tid, ids) for _rid, tid, ids in items], group)
            except ValueError:  # no pairs to that group (any more): nothing went ahead; send_many reports it
                continue
            for rid, tid, _ids in items:
                self._announced[rid] = (tid, group)

    def _send_handoffs(self) -> None:
        """Send the KV of the requests this step handed off: one payload per decode group and pair for all of
        them (one transfer's fixed costs instead of one per request, which would queue on the pair). Requests
        announced and then ended by their first token go as withdrawn in the same call, and so does any other
        announced request not handed off (a step that failed: its pages stay with the request)."""
        if not (self._to_send or self._to_withdraw or self._announced):
            return  # the common step (decode, or no prompt finished)
        sending = {rid for rid, _ids, _meta in self._to_send}
        for rid, (tid, group) in self._announced.items():
            if rid not in sending:
                self._to_withdraw[tid] = (group, None)
        by_group: dict[str, tuple[list, list]] = {}
        for rid, page_ids, meta in self._to_send:
            by_group.setdefault(self._handoffs[rid].group, ([], []))[0].append((rid, page_ids, meta))
        for tid, (group, _seq_id) in self._to_withdraw.items():
            by_group.setdefault(group, ([], []))[1].append(tid)
        to_withdraw, self._to_send, self._to_withdraw, self._announced = self._to_withdraw, [], {}, {}
        now = time.monotonic()
        for tid in to_withdraw:
            self._withdrawn[tid] = (to_withdraw[tid][1], now)
        for group, (items, withdrawn) in by_group.items():
            for rid, _ids, _meta in items:
                self._mark("send", rid)
            kwargs = {"withdrawn": withdrawn} if withdrawn else {}
            try:
                for agent in self.agents:
                    agent.send_many([(self._handoffs[rid].transfer_id, ids, meta) for rid, ids, meta in items], group,
                                    **kwargs)
            except ValueError as e:  # no pairs to that group (any more)
                for rid, _ids, _meta in items:
                    self.pages.free(self._handoffs.pop(rid).seq_id)
                    self._outcomes.append((rid, False, f"not sent: {e}"))
                continue
            now = time.monotonic()
            for rid, _ids, _meta in items:
                self._handoffs[rid].sent = True
                self._handoffs[rid].created = now  # the lease runs from the send

    # ---- disaggregation ---------------------------------------------------------------------------------
    def admit_remote(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                     group: str, transfer_id: str | None = None, prompt: str | None = None,
                     arrival_time: float | None = None, first_from_kv: bool = True) -> list[int] | None:
        """Decode role: reserve the pages of a prompt computed by prefill group `group` and expect its KV
        (under `transfer_id`, default the request id). Returns the page ids, or None when the pool has no room
        now; ValueError (naming the field) for a request that can never be served here. `first_from_kv`: the
        first token comes in the KV header and decoding starts when the pages land (else at `continue_remote`)."""
        if self.role != "decode":
            raise ValueError(f"role: only a decode engine admits remote prefills (this one is {self.role})")
        req = self.scheduler.add_remote(request_id, prompt_token_ids, params, arrival_time=arrival_time)
        if req is None:
            return None
        seq = req.seqs[0]
        page_ids = list(self.pages.page_table(seq.seq_id))
        tid = transfer_id or request_id
        try:
            for agent in self.agents:
                agent.prepare(tid, page_ids, group)
        except ValueError:
            for agent in self.agents:  # a shard that did prepare: let it go again
                with _suppress():
                    agent.abort(tid)
                    agent.release(tid)
            self.scheduler.abort(request_id)
            raise
        self._remote[request_id] = _Remote(transfer_id=tid, created=time.monotonic(), first_from_kv=first_from_kv)
        self._mark("admitted", request_id)
        self._track(req, prompt)
        return page_ids

    def continue_remote(self, request_id: str, first_token: int,
                        first_logprobs: dict[int, float] | None = None) -> None:
        """Decode role: the first token (sampled by the prefill engine) of an admitted request; it decodes on
        once its KV has landed. A request already decoding (its first token came with the KV) goes on as it is."""
        remote = self._remote.get(request_id)
        if remote is None and request_id in self._tracked:
            return  # started when its KV landed
        if remote is None or remote.aborted:
            raise KeyError(f"request_id: {request_id!r} is not awaiting its KV here (unknown, failed or aborted)")
        if remote.first is None:  # one from the KV header stays (the same sample)
            remote.first = (int(first_token), first_logprobs)
            self._mark("first_known", request_id)

    def fail_remote(self, request_id: str, why: str) -> bool:
        """Decode role: the request's KV will not come (its prefill reported the transfer failed): fail it now
        (its stream gets `KVTransferFailed(why)`) rather than at its lease. False when it is not awaiting its KV
        (unknown, landed already, or failed/aborted before)."""
        remote = self._remote.get(request_id)
        if remote is None or remote.aborted or remote.landed:
            return False
        self._fail_remote(request_id, why)
        return True

    def _abort_remote(self, request_id: str) -> bool:
        remote = self._remote[request_id]
        remote.aborted = True
        if self._abort_on_every_agent(remote.transfer_id):
            self._drop_remote(request_id)
        return True

    def _fail_remote(self, request_id: str, why: str) -> None:
        """The request's KV cannot come: report it now, free its pages once every shard's part settled."""
        remote = self._remote[request_id]
        remote.aborted, remote.failure = True, why
        self._failures.append((request_id, why))
        if self._abort_on_every_agent(remote.transfer_id):
            self._drop_remote(request_id)

    def _abort_on_every_agent(self, transfer_id: str) -> bool:
        """Abort a transfer on every shard's agent (each must hear it, even after one whose part is still in
        flight); True when all parts have settled."""
        settled = [agent.abort(transfer_id) for agent in self.agents]
        return all(settled)

    def _drop_remote(self, request_id: str) -> None:
        """Forget a remote request whose transfer settled; free its pages (abort or failure)."""
        remote = self._remote.pop(request_id)
        failure = remote.failure
        for agent in self.agents:
            with _suppress():
                agent.release(remote.transfer_id)
        req = self.scheduler.abort(request_id)
        tracked = self._tracked.pop(request_id, None)
        if req is not None:
            self._released_seq_ids.extend(s.seq_id for s in req.seqs)
        if tracked is not None:
            if failure is not None:
                tracked.stats.failure_reason = "transfer"
            self._close_stats(tracked, "abort" if failure is None else "error")

    def _combined(self, transfer_ids: list[str]) -> dict[str, TransferResult]:
        """Each request's transfer over every shard of this group: one `results` call per agent for all of
        them (a worker group's agent answers them in one round trip per shard)."""
        if not transfer_ids:
            return {}
        per_agent = [agent.results(transfer_ids) for agent in self.agents]
        return {tid: TransferAgent.combine(tid, [res[i] for res in per_agent])
                for i, tid in enumerate(transfer_ids)}

    def poll_transfers(self) -> list[RequestOutput]:
        """Move disaggregated requests on (non-blocking): free a prefill's pages once its transfer settled or
        its lease expired; start decoding a request whose KV landed and whose first token is known; fail one
        whose KV cannot come. Returns the outputs of requests that started decoding."""
        now = time.monotonic()
        lease = self.transfer_config.lease_s
        results = self._combined([h.transfer_id for h in self._handoffs.values() if h.sent]
                                 + [r.transfer_id for r in self._remote.values()] + list(self._withdrawn))
        self._settle_withdrawn(results, now - lease)
        for rid, h in list(self._handoffs.items()):
            if not h.sent:
                continue
            res = results[h.transfer_id]
            if res.settled:
                for agent in self.agents:
                    agent.release(h.transfer_id)
                del self._handoffs[rid]
                self.pages.free(h.seq_id)
                ok = res.state is TransferState.DONE
                self._outcomes.append((rid, ok, None if ok else res.reason or "failed"))
                self._mark("settled", rid, res.marks)
            elif now - h.created > lease:  # nobody collected it: stop, free once the wire lets go
                for agent in self.agents:
                    agent.abort(h.transfer_id)
        outputs = []
        for rid, r in list(self._remote.items()):
            res = results[r.transfer_id]
            if r.aborted:
                if res.settled:
                    self._drop_remote(rid)
                continue
            if res.state is TransferState.FAILED:
                self._fail_remote(rid, f"KV transfer failed: {res.reason}")
                continue
            if res.state is TransferState.DONE and not r.landed:
                r.landed = True
                self._mark("landed", rid, res.marks)
                if r.first is None and r.first_from_kv and res.meta is not None:
                    r.first = first_token_from_meta(res.meta)
                    self._mark("first_known", rid)
            if r.landed and r.first is not None:
                outputs.extend(self._activate(rid, r))
            elif now - r.created > lease:
                why = "the first token never came" if r.landed else "no KV arrived"
                self._fail_remote(rid, f"lease expired after {lease:g} s: {why}")
        for agent in self.agents:
            stats = agent.pop_stats()
            if self.role == "prefill":  # one record per transfer: the sender's (the receiver's is the same bytes)
                self._transfer_stats.extend(stats)
        return outputs

    def _settle_withdrawn(self, results: dict[str, TransferResult], stale: float) -> None:
        """Free the pages of withdrawn transfers once their bytes left (or at the lease)."""
        for tid, (seq_id, since) in list(self._withdrawn.items()):
            if not results[tid].settled:
                if since < stale:
                    for agent in self.agents:
                        agent.abort(tid)
                continue
            for agent in self.agents:
                agent.release(tid)
            del self._withdrawn[tid]
            if seq_id is not None:
                self.pages.free(seq_id)

    def _activate(self, rid: str, r: _Remote) -> list[RequestOutput]:
        del self._remote[rid]
        self._mark("activated", rid)
        for agent in self.agents:
            agent.release(r.transfer_id)
        token, logprobs = r.first
        t = self._tracked[rid]
        seq = self.scheduler.activate_remote(rid, token)
        self._on_token(t, seq, token, logprobs, time.monotonic())
        out = self._output(t)
        if t.req.finished:
            self._retire(t)
        return [out]

    def pop_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of decode requests that failed for their KV since the last call."""
        out, self._failures = self._failures, []
        return out

    def pop_transfer_outcomes(self) -> list[tuple[str, bool, str | None]]:
        """Prefill: (request id, ok, reason) of every handed-off request whose transfer settled."""
        out, self._outcomes = self._outcomes, []
        return out

    def pop_transfer_stats(self) -> list[TransferStats]:
        out, self._transfer_stats = self._transfer_stats, []
        return out

    def add_transfer_listener(self, fn) -> None:
        """`fn()` is called (from a transfer thread) whenever a transfer of this engine settles."""
        for agent in self.agents:
            agent.add_listener(fn)

    # pairs (each shard's agent takes the routes of its tp rank; the lists cover every shard of the group)
    def kv_listen(self, group: str, remote_tp: int, remote_dp: int = 1) -> list:
        """Decode role: open the pairs from prefill group `group` (tp `remote_tp`); returns what its shards
        `kv_connect` to: [(route as a dict, (host, port))].

        A prefill group with attention DP (`remote_dp` > 1) sends each request from the shards of the dp rank
        that ran it, so each of its dp ranks needs pairs of its own: they are opened under the sub-group
        `TransferAgent.dp_group(group, q)` and each entry is tagged "src_dp": q (the prefill engine hands dp
        rank q its entries). A request that prefill dp rank q computes is admitted under that sub-group;
        `kv_drop`, `kv_broken` and `kv_wait_ready` of `group` cover all of them."""
        if remote_dp == 1:
            return [x for agent in self.agents for x in agent.listen(group, remote_tp)]
        self.kv_drop(group)  # a previous listen of this name (split or not)
        subs = [TransferAgent.dp_group(group, q) for q in range(remote_dp)]
        self._split[group] = subs
        return [({**route, "src_dp": q}, address) for q, sub in enumerate(subs) for agent in self.agents
                for route, address in agent.listen(sub, remote_tp)]

    def _family(self, group: str) -> list[str]:
        """The pair groups behind the name `group`: its prefill-dp sub-groups when split, else itself."""
        return self._split.get(group, [group])

    def kv_connect(self, group: str, listened: list) -> None:
        """Prefill role: join the pairs decode group `group` listens on (returns at once; see kv_wait_ready)."""
        tagged = sorted({route["src_dp"] for route, _address in listened if "src_dp" in route})
        if tagged:  # the decode side opened pairs per prefill dp rank: a DPEngine hands each rank its own
            raise ValueError(f"listened: pairs for prefill dp ranks {tagged}, but this prefill engine has dp=1 "
                             f"(the decode side must listen with remote_dp=1)")
        for agent in self.agents:
            agent.connect(group, listened)

    def kv_wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        for g in [None] if group is None else self._family(group):
            for agent in self.agents:
                agent.wait_ready(timeout_s, g)

    def kv_drop(self, group: str) -> None:
        for g in self._split.pop(group, [group]):
            for agent in self.agents:
                agent.drop(g)

    def kv_broken(self, group: str) -> str | None:
        return next((why for g in self._family(group) for agent in self.agents if (why := agent.broken(g))), None)

    def set_transfer_faults(self, faults: dict[str, str]) -> None:
        """Tests and drills: break the transfers of these ids (FaultyChannel kinds) on this prefill engine."""
        for agent in self.agents:
            agent.set_faults(faults)

    def hold_pages(self, num_pages: int) -> int:
        """Take `num_pages` free pages out of the pool (tests and drills: a full decode replica); 0 gives them
        back. Returns how many are held."""
        self.pages.free(_HOLD_SEQ_ID)
        if num_pages > 0:
            self.pages.admit(_HOLD_SEQ_ID)
            if not self.pages.allocate(_HOLD_SEQ_ID, num_pages * self.page_size):
                self.pages.free(_HOLD_SEQ_ID)
                raise ValueError(f"num_pages: only {self.pages.num_free_pages} pages are free")
        return num_pages

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
        if seq.finished and not t.stopped_by_string[i] and seq.finish_reason != "handoff":
            t.texts[i] += t.detoks[i].flush()

    def _output(self, t: _Tracked) -> RequestOutput:
        req = t.req
        outs = []
        for seq in req.seqs:
            i = seq.index
            text = t.texts[i]
            handoff = seq.finish_reason == "handoff"  # the request goes on elsewhere: as unfinished here
            if t.holdback and (seq.finish_reason is None or handoff):
                # Never show the start of a stop string a later token may complete (the text would shrink).
                text = text[:max(len(text) - t.holdback, 0)]
            outs.append(CompletionOutput(index=i, token_ids=seq.output_token_ids, text=text,
                                         logprobs=list(t.logprobs[i]) if t.logprobs[i] is not None else None,
                                         finish_reason=None if handoff else seq.finish_reason,
                                         stop_reason=seq.stop_reason))
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
        # decode: requests whose pages are reserved while their KV arrives count as running
        return EngineStats(role=self.role, num_running=self.scheduler.num_running + len(self._remote),
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

    def _mark(self, kind: str, request_id: str, phases: Mapping[str, float] | None = None) -> None:
        """Record a handoff event: (time.time(), kind, request id, the transfer's phase marks or None). Wall
        clock, so the prefill and decode replicas' marks and the benchmark client's times share one axis; the
        transfer's marks (time.monotonic()) are moved onto it here."""
        now = time.time()
        if phases:
            shift = now - time.monotonic()
            phases = {k: v + shift for k, v in phases.items()}
        self.marks.append((now, kind, request_id, phases or None))

    def shutdown(self) -> None:
        for agent in self.agents:
            with _suppress():
                agent.close()
        self.executor.shutdown()


_HOLD_SEQ_ID = -1  # the page manager owner of `Engine.hold_pages`
_MAX_MARKS = 50_000  # about 6 marks per disaggregated request


def _suppress():
    import contextlib

    return contextlib.suppress(Exception)
