"""Continuous-batching scheduler (pure Python): decides, each step, which tokens of which sequences to compute.

One step's work is a list of *chunks*: a chunk is `num_tokens` new tokens of one sequence starting at `start`
(the number of its tokens already in the KV cache). A running sequence still short of its known tokens (prompt,
or prompt + outputs after a preemption) gets a prefill chunk as large as the step's token budget allows
(chunked prefill: a long prompt spreads over steps and shares them with decode rows); a generating sequence gets a
one-token decode chunk. The output lists prefill chunks first and decode chunks as the suffix (the model's
`ChunkSpec` contract).

Memory: pages come from `PageManager`. When a running sequence cannot get a page, the newest running sequence is
preempted by recompute: its pages are released (its full pages stay in the prefix cache, so recompute is often
cheap), and it goes back to the front of the waiting queue, keeping its generated tokens. Nobody fails for lack of
memory; requests that could never fit the pool are refused at `add_request`.

Arrivals while others decode (`prefill_batch_wait_s`): a fresh prompt at the head of the waiting queue sits
steps out, up to that long from when it was queued, while the step decodes, so that prompts arriving a few ms
apart share one prefill step instead of each stalling the decoding streams with its own. Nothing is held when no
row decodes, when the waiting prompts already fill the step's budget or the free seats, or for a preempted or
forked sequence.

Stops: EOS (unless `ignore_eos`), `stop_token_ids`, `max_tokens`, `max_model_len` are checked here; EOS and stop
ids only once `min_tokens` tokens exist. Stop *strings* need text, so the engine checks them with its
detokenizer and calls `finish()`.

`n > 1`: the request's sample 0 runs first; when its prompt is computed, samples 1..n-1 are forked from it:
they share its full prompt pages by reference and compute the partial last prompt page themselves (see
`workers/pages.py` for why that beats copy-on-write), then sample independently.

Disaggregation (docs/disaggregation.md): on a prefill engine a request added with `handoff=True` runs its
prompt and samples one token; if that token does not end it, the sequence finishes with reason "handoff" and
keeps its pages (the engine frees them once the KV transfer settled). On a decode engine `add_remote` reserves
the pages of a prompt computed elsewhere (status REMOTE: outside both queues); `activate_remote` appends the
first token the prefill engine sampled and queues the sequence for its first decode step (`remote_ready`,
admitted ahead of the waiting queue since its pages are already held).

Async scheduling (workers/engine_api.py): the engine schedules step n+1 while step n still runs. `advance(n)`
accounts n's chunks as computed and gives every sampling sequence a placeholder token (`PENDING_TOKEN`, the
sequence `pending`), so `schedule()` gives it its next decode chunk, whose input the device takes from n's sampled
ids; `resolve(n, tokens)` then puts the real tokens in place and checks the stops as `update` does. A sequence that
n finishes has a wasted row in n+1 (its result is ignored); one whose placeholder is sure to end it by length
(max_tokens, max_model_len) is not scheduled at all, so no page is taken for it.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence as Seq
from dataclasses import dataclass, field

from workers.config import EngineConfig
from workers.pages import PageManager, PrefixHit
from workers.request import SamplingParams


PENDING_TOKEN = -1  # a token sampled by a step still in flight (async scheduling); never a vocabulary id


class SeqStatus(enum.Enum):
    PENDING_FORK = "pending_fork"  # sample i > 0 waiting for sample 0's prompt
    REMOTE = "remote"  # decode engine: pages reserved, the prompt's KV is computed and sent by a prefill engine
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of one request: its tokens and how many of them are in the KV cache."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens", "status",
                 "finish_reason", "stop_reason", "num_preemptions", "generator", "pending")

    def __init__(self, seq_id: int, request: Request, index: int, status: SeqStatus) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = status
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.generator = None  # the engine's per-sample RNG (torch.Generator) when seeded; opaque here
        self.pending = False  # token_ids[-1] is PENDING_TOKEN: sampled by a step in flight, not known yet

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, id={self.seq_id}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


@dataclass(eq=False, kw_only=True)
class Request:
    """One client request: `n` samples of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # effective: params.max_tokens or what max_model_len leaves
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    first_scheduled_time: float | None = None
    prefix_cache_hit_tokens: int = 0
    handoff: bool = False  # prefill engine: after the first token, keep the pages for the decode engine
    queued_at: float = 0.0  # the scheduler's clock when it was queued (`prefill_batch_wait_s` counts from it)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` new tokens of `seq` at positions start..start+num_tokens-1. `sample`: the chunk reaches the
    sequence's last known token, so its logits give the next token (a partial prefill chunk's do not)."""

    seq: Sequence
    start: int
    num_tokens: int
    is_decode: bool
    sample: bool

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens]


@dataclass(frozen=True, kw_only=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # prefill chunks first, decode chunks last
    preempted: list[Sequence]
    num_prefill_tokens: int
    num_decode_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, kw_only=True)
class UpdateResult:
    new_tokens: list[tuple[Sequence, int]]  # (seq, token) for every token appended this step
    finished: list[Sequence]  # sequences that finished this step (pages already freed)


class Scheduler:
    def __init__(self, config: EngineConfig, pages: PageManager, *, eos_token_ids: Iterable[int] = (),
                 vocab_size: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pages = pages
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is the newest (first preempted)
        self.requests: dict[str, Request] = {}
        self.remote_ready: deque[Sequence] = deque()  # decode: KV landed, first token known, not yet running
        self.num_preemptions = 0  # cumulative
        self._next_seq_id = 0

    # ---- requests ---------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    arrival_time: float | None = None, handoff: bool = False) -> Request:
        """Queue a request. Raises ValueError naming the field for a request that can never be served.
        `handoff` (prefill engine): stop after the first token and keep the pages for a KV transfer."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        prompt = [int(t) for t in prompt_token_ids]
        max_tokens = self.validate(prompt, params)
        if handoff and params.n != 1:
            raise ValueError(f"n: disaggregated serving runs one sample per request, got n={params.n}")
        # no handoff when the first token is the last one anyway (max_tokens 1, or the context is full)
        handoff = handoff and max_tokens > 1 and len(prompt) + 1 < self.config.max_model_len
        req = Request(request_id=request_id, prompt_token_ids=prompt, params=params,
                      max_tokens=1 if handoff else max_tokens, handoff=handoff,
                      arrival_time=self.clock() if arrival_time is None else arrival_time, queued_at=self.clock())
        for i in range(params.n):
            seq = Sequence(self._next_seq_id, req, i, SeqStatus.WAITING if i == 0 else SeqStatus.PENDING_FORK)
            self._next_seq_id += 1
            req.seqs.append(seq)
        self.requests[request_id] = req
        self.waiting.append(req.seqs[0])
        return req

    def validate(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's effective max_tokens; ValueError naming the field if it can never be served.
        Reads only configuration, so it is safe to call from another thread."""
        cfg = self.config
        if not prompt:
            raise ValueError("prompt_token_ids: the prompt is empty")
        if self.vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            # a stop id past the vocabulary would index the logits out of range on the device (min_tokens)
            bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(f"prompt_token_ids: the prompt has {len(prompt)} tokens, max_model_len is "
                             f"{cfg.max_model_len} (room for at least one generated token is needed)")
        pool_tokens = self.pages.num_pages * self.pages.page_size
        if params.max_tokens is None:
            # "As long as it takes": up to max_model_len, or what one sequence can hold in the whole pool.
            max_tokens = max(min(cfg.max_model_len - len(prompt), pool_tokens - len(prompt) + 1), 1)
        elif len(prompt) + params.max_tokens > cfg.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({cfg.max_model_len})")
        else:
            max_tokens = params.max_tokens
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs ({cfg.max_num_seqs})")
        # The last generated token is never written to the cache, hence the -1.
        need = self.pages.pages_for(len(prompt) + max_tokens - 1)
        if need > self.pages.num_pages:
            field_name = "prompt_token_ids" if self.pages.pages_for(len(prompt)) > self.pages.num_pages else "max_tokens"
            raise ValueError(f"{field_name}: the request needs up to {need} KV pages, the pool has "
                             f"{self.pages.num_pages}")
        return max_tokens

    def add_remote(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                   arrival_time: float | None = None) -> Request | None:
        """Decode engine: reserve the pages of a prompt that a prefill engine computes (status REMOTE).
        None when the pool cannot hold it now (admission watermark kept unless nothing runs); ValueError naming
        the field for a request that can never be served."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if params.n != 1:
            raise ValueError(f"n: disaggregated serving runs one sample per request, got n={params.n}")
        prompt = [int(t) for t in prompt_token_ids]
        max_tokens = self.validate(prompt, params)
        empty = PrefixHit((), (), self.pages.page_size)
        if not self.pages.can_admit(len(prompt), empty, ignore_watermark=not self.running):
            return None
        req = Request(request_id=request_id, prompt_token_ids=prompt, params=params, max_tokens=max_tokens,
                      arrival_time=self.clock() if arrival_time is None else arrival_time, forked=True)
        seq = Sequence(self._next_seq_id, req, 0, SeqStatus.REMOTE)
        self._next_seq_id += 1
        req.seqs.append(seq)
        self.pages.admit(seq.seq_id)
        ok = self.pages.allocate(seq.seq_id, len(prompt))
        assert ok, "can_admit promised these pages"
        self.requests[request_id] = req
        return req

    def activate_remote(self, request_id: str, first_token: int) -> Sequence:
        """Decode engine: the prompt's KV landed and `first_token` is known; the sequence decodes from here
        (its pages hold the prompt, so `num_computed_tokens` = prompt length). Returns it (finished if the
        token ends it)."""
        req = self.requests[request_id]
        seq = req.seqs[0]
        if seq.status is not SeqStatus.REMOTE:
            raise ValueError(f"request_id: {request_id!r} is {seq.status.value}, not awaiting its KV")
        seq.token_ids.append(int(first_token))
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.pages.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        seq.status = SeqStatus.WAITING
        stop = self._check_stop(seq, int(first_token))
        if stop is not None:
            self._finish(seq, *stop)
            self.requests.pop(request_id, None)
        else:
            self.remote_ready.append(seq)
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> Request | None:
        """Finish every unfinished sample of the request with `reason` ('abort', or 'error': a failed step),
        freeing its pages. None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, reason, None)
        return req

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence from outside (the engine, on a stop string). Frees its pages."""
        if not seq.finished:
            self._finish(seq, reason, stop_reason)
            if seq.request.finished:
                self.requests.pop(seq.request.request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_ready)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks: running sequences first (oldest first), then new admissions if no one was
        preempted this step. The token budget caps the step's total tokens."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending and self._ends_by_length(seq):
                i += 1  # its token in flight is its last: a row now would be wasted and might take a page
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow_or_preempt(seq, n, preempted):
                break  # seq preempted itself: it was the newest, nothing after it
            chunks.append(self._chunk(seq, n))
            budget -= n
            i += 1

        if not preempted:
            budget = self._admit(budget, chunks)

        prefill = [c for c in chunks if not c.is_decode]
        decode = [c for c in chunks if c.is_decode]
        return SchedulerOutput(chunks=prefill + decode, preempted=preempted,
                               num_prefill_tokens=sum(c.num_tokens for c in prefill), num_decode_tokens=len(decode))

    def _grow_or_preempt(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Get pages for `n` more tokens of `seq`, preempting the newest running sequences until they fit.
        False if `seq` itself had to go."""
        while not self.pages.allocate(seq.seq_id, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Move waiting sequences to running, first come first served, while budget, seats and pages last."""
        max_seqs = self.config.max_num_seqs
        # Running sample-0 sequences hold seats for the samples they will fork.
        seats_taken = sum(1 if q.index or q.request.forked else q.request.params.n for q in self.running)
        # Sequences whose prompt KV came from a prefill engine hold their pages already: they go first.
        while self.remote_ready and budget > 0 and seats_taken < max_seqs:
            seq = self.remote_ready[0]
            if not self.pages.allocate(seq.seq_id, seq.num_tokens):
                break
            self.remote_ready.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats_taken += 1
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = self.clock()
            chunks.append(self._chunk(seq, seq.num_tokens - seq.num_computed_tokens))
            budget -= 1
        if self._hold_arrivals(chunks, budget, max_seqs - seats_taken):
            return budget
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            req = seq.request
            seats = 1 if req.forked or seq.index > 0 else req.params.n
            if seats_taken + seats > max_seqs:
                break
            # Prompt logprobs need the logits of every prompt position: cached pages would skip them.
            hit = (self.pages.find_cached_prefix(seq.token_ids) if req.params.prompt_logprobs is None
                   else PrefixHit((), (), self.pages.page_size))
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.pages.can_admit(hit.num_tokens + n, hit, ignore_watermark=not self.running):
                break  # head-of-line: keep arrival order
            self.waiting.popleft()
            self.pages.admit(seq.seq_id, hit)
            ok = self.pages.allocate(seq.seq_id, hit.num_tokens + n)
            assert ok, "can_admit promised these pages"
            seq.num_computed_tokens = hit.num_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats_taken += seats
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
                req.prefix_cache_hit_tokens = hit.num_tokens
            chunks.append(self._chunk(seq, n))
            budget -= n
        return budget

    def _hold_arrivals(self, chunks: list[ScheduledChunk], budget: int, free_seats: int) -> bool:
        """Whether the waiting prompts sit this step out so that later arrivals share their prefill step
        (`prefill_batch_wait_s`): only while this step decodes (otherwise the device would idle), for a fresh
        prompt at the head of the queue (never a preempted or forked sequence), until it has waited that long or
        the waiting prompts fill the step's token budget or the free seats."""
        wait = self.config.prefill_batch_wait_s
        if wait <= 0.0 or not self.waiting or not any(c.is_decode for c in chunks):
            return False
        head = self.waiting[0]
        if head.index or head.num_preemptions or head.num_output_tokens:
            return False
        if self.clock() - head.request.queued_at >= wait:
            return False
        tokens = 0
        for i, seq in enumerate(self.waiting):
            tokens += seq.num_tokens
            if tokens >= budget or i + 1 >= free_seats:
                return False
        return True

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        sample = start + n == seq.num_tokens
        is_decode = n == 1 and sample and seq.num_output_tokens > 0
        return ScheduledChunk(seq, start, n, is_decode, sample)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # later preemptions are older sequences: they end up in front

    # ---- after the step ---------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled_token_ids: Seq[int | None]) -> UpdateResult:
        """Account the computed chunks and append the sampled tokens (`sampled_token_ids[i]` for
        `output.chunks[i]`; ignored where the chunk does not sample). Checks every stop but stop strings."""
        new_tokens: list[tuple[Sequence, int]] = []
        finished: list[Sequence] = []
        for chunk, token in zip(output.chunks, sampled_token_ids, strict=True):
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted or finished since scheduling
            seq.num_computed_tokens += chunk.num_tokens
            self.pages.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if not chunk.sample:
                continue
            if token is None:
                raise ValueError(f"no sampled token for {seq}")
            seq.token_ids.append(int(token))
            new_tokens.append((seq, int(token)))
            self._after_token(seq, int(token), finished)
        return UpdateResult(new_tokens=new_tokens, finished=finished)

    def advance(self, output: SchedulerOutput) -> None:
        """Async scheduling: account the chunks of `output` (a step still running) as computed and give each
        sampling sequence a placeholder for its token, so the next `schedule()` can follow it. Prefix-cache
        pages are published as `update` would: they hold only known tokens (the placeholder is never computed
        by this step)."""
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted or finished since scheduling
            seq.num_computed_tokens += chunk.num_tokens
            self.pages.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if chunk.sample:
                seq.token_ids.append(PENDING_TOKEN)
                seq.pending = True

    def resolve(self, output: SchedulerOutput, sampled_token_ids: Seq[int | None]) -> UpdateResult:
        """Async scheduling: the tokens of a step `advance` accounted: each placeholder still held (by a running
        sequence, or one preempted since, which keeps its token as `update` would have) becomes its token; then
        forks and stops as in `update`. A sequence that finished meanwhile dropped its placeholder: its token is
        discarded."""
        new_tokens: list[tuple[Sequence, int]] = []
        finished: list[Sequence] = []
        for chunk, token in zip(output.chunks, sampled_token_ids, strict=True):
            seq = chunk.seq
            if not chunk.sample or not seq.pending:
                continue
            if token is None:
                raise ValueError(f"no sampled token for {seq}")
            seq.token_ids[-1] = int(token)
            seq.pending = False
            new_tokens.append((seq, int(token)))
            self._after_token(seq, int(token), finished)
        return UpdateResult(new_tokens=new_tokens, finished=finished)

    def _after_token(self, seq: Sequence, token: int, finished: list[Sequence]) -> None:
        """A sampled token was appended: fork the other samples after sample 0's first, check the stops."""
        req = seq.request
        if seq.index == 0 and not req.forked and seq.num_output_tokens == 1:
            self._fork(req)
        stop = self._check_stop(seq, token)
        if stop is not None:  # (async: a sequence preempted while its token was in flight ends from the queue)
            self._finish(seq, *stop)
            finished.append(seq)
            if req.finished:
                self.requests.pop(req.request_id, None)

    def _ends_by_length(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.config.max_model_len

    def _fork(self, req: Request) -> None:
        """Start samples 1..n-1 from sample 0's computed prompt: full pages shared, the tail recomputed."""
        req.forked = True
        parent = req.seqs[0]
        if parent.status is not SeqStatus.RUNNING:
            # async: sample 0 was preempted while its first token was in flight, its pages gone: the other
            # samples queue behind it and compute their prompts (from the prefix cache where it still holds them)
            for seq in req.seqs[1:]:
                seq.status = SeqStatus.WAITING
                self.waiting.append(seq)
            return
        shared = (parent.num_prompt_tokens - 1) // self.pages.page_size  # leave >= 1 token to compute for logits
        for seq in req.seqs[1:]:
            self.pages.share(seq.seq_id, parent.seq_id, shared)
            seq.num_computed_tokens = shared * self.pages.page_size
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        req = seq.request
        n_out = seq.num_output_tokens
        if n_out >= req.params.min_tokens:
            if token in self.eos_token_ids and not req.params.ignore_eos:
                return "stop", None
            if token in req.params.stop_token_ids:
                return "stop", token
        if n_out >= req.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if seq.pending:  # its token in flight is discarded
            seq.token_ids.pop()
            seq.pending = False
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            if seq in self.remote_ready:
                self.remote_ready.remove(seq)
            else:
                self.waiting.remove(seq)
        if reason == "length" and seq.request.handoff:
            reason = "handoff"  # the pages stay: the engine frees them once the KV transfer settled
        else:
            self.pages.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
