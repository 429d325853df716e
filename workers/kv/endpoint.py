"""Bookkeeping shared by both ends: one pair operation (`_Op`), its result (`TransferResult`), an endpoint's
state machine over its pairs (`_Endpoint`) and the thread that drives one pair (`_PairWorker`)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.page_copy import PageCopyPlan
from msa.kv_cache import KVCache
from workers.kv.config import TransferConfig, TransferState, _LAYOUTS_KEPT
from workers.kv.routes import Route
from workers.kv.transport import PairChannel, TransferError, TransferTimeout, poll_until
from workers.kv.wire import KVHeader, chunk_nbytes, plan_chunks
from workers.stats import TransferStats


@dataclass(kw_only=True)
class _Op:
    """One request on one pair."""

    request_id: str
    peer: str
    page_ids: torch.Tensor  # [n] int64 on the cache's device (a sender's: on the host; CUDA gathers read them
    # from the pair's pinned buffer)
    created: float
    state: TransferState = TransferState.PENDING
    reason: str | None = None
    started: float | None = None
    finished: float | None = None
    num_bytes: int = 0
    aborted: bool = False
    ready_event: Any = None  # sender on CUDA: the caller's stream has produced the pages by then
    meta: dict | None = None  # sender: rides in the header; receiver: what the header carried
    announced: bool = False  # sender: registered by `announce`; `send_many` (or its `withdrawn`) completes it
    withdrawn: bool = False  # sender: announced, then not sent (the first token ended the request)
    released: bool = False  # sender: announced, then sent or withdrawn (once only)
    marks: dict[str, float] = field(default_factory=dict)  # phase name -> time.monotonic() (see TransferResult)


def _mark(ops: Sequence[_Op], phase: str) -> None:
    """Stamp a phase on every op (time.monotonic(): the transfer's timeline, see TransferResult.marks)."""
    now = time.monotonic()
    for op in ops:
        op.marks[phase] = now


@dataclass(frozen=True, kw_only=True)
class TransferResult:
    """The state of one request over all its pairs on this end.

    state: FAILED if any pair failed, DONE if all are done, TRANSFERRING if any started, else PENDING.
    settled: every pair operation is DONE or FAILED (the request's pages may be freed on this end).
    """

    request_id: str
    state: TransferState
    settled: bool
    reason: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0
    num_pages: int = 0
    # when each phase ended, time.monotonic() (system-wide: comparable between processes of one host); the
    # latest over the pairs. Sender: announced (its header went ahead), called (send), encoded (header built),
    # header (header written), uploaded (page ids queued to the device), staged (first staging buffer), gather0
    # and send0 (first chunk's copy launched / send posted), posted (payload and status receive posted), acked
    # (status read). Receiver: header (header read), decoded, recv0 (first receive posted), claimed, posted
    # (receives and scatters queued), landed (pages written).
    marks: Mapping[str, float] = field(default_factory=dict)
    meta: dict | None = None  # the sender's `send(..., meta=)`: as sent / as its header arrived (else None)


class _Endpoint:
    """Ops of every request on this end, their states, and the pair workers."""

    role = "?"

    def __init__(self, kv: KVCache, *, kv_head_start: int = 0, config: TransferConfig = TransferConfig()) -> None:
        self.kv = kv
        self.config = config
        self.kv_head_start = kv_head_start
        self.num_local_heads = kv.k[0].shape[2]
        self.device = kv.k[0].device
        self.dtype = kv.k[0].dtype
        self.index_layers = tuple(i for i, t in enumerate(kv.index_k) if t is not None)
        self._ops: dict[str, dict[str, _Op]] = {}
        self._cond = threading.Condition()
        self._workers: dict[str, _PairWorker] = {}
        self._stats: list[TransferStats] = []
        self._listeners: list = []  # called (no lock held) whenever an op settles: wakes an engine's step loop

    def _worker_class(self) -> type:
        """The pair worker of this end (KVSender / KVReceiver say which)."""
        raise NotImplementedError

    def add_peer(self, name: str, channel: PairChannel, route: Route) -> None:
        """Start the worker of one pair (it opens the channel in the background; see `wait_ready`)."""
        if name in self._workers:
            raise ValueError(f"name: peer {name!r} already added")
        self._check_peer(channel, route)
        w = self._worker_class()(self, name, channel, route)
        self._workers[name] = w
        w.start()

    def add_listener(self, fn) -> None:
        """Call `fn()` whenever an op of this end settles (from whichever thread settled it; keep it cheap)."""
        self._listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._listeners:
            try:
                fn()
            except Exception:
                pass

    def remove_peer(self, name: str) -> None:
        """Stop and close one pair (a broken one, replaced under a new name). Its unsettled ops end FAILED."""
        w = self._workers.pop(name, None)
        if w is None:
            return
        w.stop()
        w.thread.join(timeout=2.0)
        w.channel.close()
        self._fail_unsettled(name, f"pair_broken: pair {name} removed")

    # --- peers ---
    def _check_peer(self, channel: PairChannel, route: Route) -> None:
        """A pair this end can serve: its route's heads are this shard's, and an NCCL channel outlasts a transfer."""
        lo, hi = self.kv_head_start, self.kv_head_start + self.num_local_heads
        if not lo <= route.head_start < route.head_end <= hi:
            raise ValueError(f"route: heads [{route.head_start}, {route.head_end}) are not within this shard's "
                             f"heads [{lo}, {hi})")
        if getattr(channel, "backend", "gloo") == "torch-nccl" and channel.timeout_s <= self.config.timeout_s:
            raise ValueError(f"channel: timeout_s {channel.timeout_s} must exceed the transfer timeout "
                             f"{self.config.timeout_s} (NCCL's watchdog would fire before this end gives up)")

    def wait_ready(self, timeout_s: float | None = None, *, peers: Sequence[str] | None = None) -> None:
        """Block until every pair (or the given `peers`) is open; raises TransferError naming a pair that
        failed to open."""
        deadline = time.monotonic() + (timeout_s or self.config.connect_timeout_s)
        workers = dict(self._workers) if peers is None else {n: self._workers[n] for n in peers}
        for name, w in workers.items():
            if not w.ready.wait(max(deadline - time.monotonic(), 0)):
                raise TransferTimeout(f"pair {name} not open in time")
            if w.broken:
                raise TransferError("pair_broken", f"pair {name}: {w.broken}")

    @property
    def peers(self) -> list[str]:
        return list(self._workers)

    def broken_peers(self) -> dict[str, str]:
        return {n: w.broken for n, w in self._workers.items() if w.broken}

    # --- states ---
    def _finish(self, op: _Op, state: TransferState, reason: str | None = None) -> None:
        """Settle one op (caller holds no lock)."""
        with self._cond:
            if op.state.final:
                return
            if op.aborted:
                state, reason = TransferState.FAILED, "aborted"
            op.state, op.reason, op.finished = state, reason, time.monotonic()
            if op.started is not None:
                self._stats.append(TransferStats(request_id=op.request_id, num_bytes=op.num_bytes,
                                                 seconds=op.finished - op.started, num_pages=op.page_ids.numel(),
                                                 ok=state is TransferState.DONE))
            self._cond.notify_all()
        self._notify()

    def _expire(self) -> None:
        """Fail prepared receives whose header never came (called with the lock held)."""

    def _result(self, request_id: str) -> TransferResult:
        self._expire()
        ops = self._ops.get(request_id)
        if not ops:
            raise KeyError(f"request_id: {request_id!r} has no transfer on this {self.role}")
        states = [op.state for op in ops.values()]
        failed = [op for op in ops.values() if op.state is TransferState.FAILED]
        if failed:
            state = TransferState.FAILED
        elif all(s is TransferState.DONE for s in states):
            state = TransferState.DONE
        elif any(s is not TransferState.PENDING for s in states):
            state = TransferState.TRANSFERRING
        else:
            state = TransferState.PENDING
        starts = [op.started for op in ops.values() if op.started is not None]
        ends = [op.finished for op in ops.values() if op.finished is not None]
        seconds = (max(ends) - min(starts)) if starts and ends and all(s.final for s in states) else 0.0
        reason = "; ".join(f"{op.peer}: {op.reason}" for op in failed) or None
        marks: dict[str, float] = {}
        for op in ops.values():
            for k, t in op.marks.items():
                marks[k] = max(t, marks.get(k, t))
        meta = next((op.meta for op in ops.values() if op.meta is not None), None)
        return TransferResult(request_id=request_id, state=state, settled=all(s.final for s in states),
                              reason=reason, num_bytes=sum(op.num_bytes for op in ops.values()), seconds=seconds,
                              num_pages=next(iter(ops.values())).page_ids.numel(), marks=marks, meta=meta)

    def state(self, request_id: str) -> TransferState:
        with self._cond:
            return self._result(request_id).state

    def result(self, request_id: str) -> TransferResult:
        with self._cond:
            return self._result(request_id)

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        """Block until the request is settled on this end (or `timeout_s` passes); returns its result."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                res = self._result(request_id)
                if res.settled:
                    return res
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return res
                # wake at least every 50 ms so receive deadlines are applied while we wait
                self._cond.wait(0.05 if left is None else min(left, 0.05))

    def abort(self, request_id: str) -> bool:
        """Abort a request (client gone). PENDING ops end FAILED("aborted") at once; an op mid-payload finishes
        moving its bytes (stopping halfway would desynchronise the pair) and then ends FAILED("aborted").
        Returns whether the request is settled now (its pages may be freed); if not, `wait` for it."""
        with self._cond:
            ops = self._ops.get(request_id, {})
            for op in ops.values():
                op.aborted = True
                if op.state is TransferState.PENDING:
                    op.state, op.reason, op.finished = TransferState.FAILED, "aborted", time.monotonic()
            self._cond.notify_all()
            settled = all(op.state.final for op in ops.values())
        self._notify()
        return settled

    def release(self, request_id: str) -> TransferResult:
        """Forget a settled request and return its final result."""
        with self._cond:
            res = self._result(request_id)
            if not res.settled:
                raise RuntimeError(f"request_id: {request_id!r} is still {res.state.value}; abort and wait first")
            del self._ops[request_id]
            return res

    def pop_stats(self) -> list[TransferStats]:
        with self._cond:
            out, self._stats = self._stats, []
            return out

    def _resolve_peers(self, peers: Sequence[str] | None) -> list[str]:
        names = list(self._workers) if peers is None else list(peers)
        unknown = [p for p in names if p not in self._workers]
        if unknown or not names:
            raise ValueError(f"peers: unknown {unknown} (this {self.role} has {list(self._workers)})")
        return names

    def _register(self, request_id: str, page_ids: Sequence[int] | torch.Tensor, peers: Sequence[str] | None,
                  *, upload: bool = True) -> dict[str, _Op]:
        """One op per peer for the request. `upload` False: the page ids stay on the host (the sender moves them
        to the device after its header left: the header needs only their count, and the upload is a
        host-synchronous copy that would otherwise delay the receiver's whole chain)."""
        names = self._resolve_peers(peers)
        if not isinstance(page_ids, torch.Tensor):  # a list: check it in Python (no tensor reductions)
            page_ids = list(page_ids)
            if page_ids and (min(page_ids) < 0 or max(page_ids) >= self.kv.num_pages):
                raise ValueError(f"page_ids: out of range [0, {self.kv.num_pages})")
            ids = torch.tensor(page_ids, dtype=torch.int64)
        else:
            ids = page_ids.to(torch.int64).reshape(-1)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.kv.num_pages):
                raise ValueError(f"page_ids: out of range [0, {self.kv.num_pages})")
        if upload:
            ids = ids.to(self.device)
        now = time.monotonic()
        with self._cond:
            if request_id in self._ops:
                raise ValueError(f"request_id: {request_id!r} already has a transfer on this {self.role}")
            ops = {p: _Op(request_id=request_id, peer=p, page_ids=ids, created=now) for p in names}
            for p, op in ops.items():
                if self._workers[p].broken:  # fail fast: the pair cannot carry anything any more
                    op.state, op.reason, op.finished = (TransferState.FAILED,
                                                        f"pair_broken: {self._workers[p].broken}", now)
            self._ops[request_id] = ops
            return ops

    def _fail_unsettled(self, peer: str, why: str) -> None:
        """The pair's worker died: every op of that pair that is not settled ends FAILED."""
        with self._cond:
            for ops in self._ops.values():
                op = ops.get(peer)
                if op is not None and not op.state.final:
                    op.state, op.reason, op.finished = TransferState.FAILED, why, time.monotonic()
            self._cond.notify_all()
        self._notify()

    def _peer_broken(self, peer: str, why: str) -> None:
        with self._cond:
            for ops in self._ops.values():
                op = ops.get(peer)
                if op is not None and op.state is TransferState.PENDING:
                    op.state, op.reason, op.finished = TransferState.FAILED, f"pair_broken: {why}", time.monotonic()
            self._cond.notify_all()
        self._notify()

    def close(self) -> None:
        for w in self._workers.values():
            w.stop()
        for w in self._workers.values():
            w.thread.join(timeout=2.0)
            w.channel.close()

    # --- staging views ---
    def _cache_view(self, family: str, layer: int, head_start: int, head_end: int) -> torch.Tensor:
        """The pages of one (family, layer), K/V narrowed to global heads [head_start, head_end)."""
        if family == "i":
            return self.kv.index_k[layer]
        cache = self.kv.k[layer] if family == "k" else self.kv.v[layer]
        lo = head_start - self.kv_head_start
        if lo == 0 and head_end - head_start == self.num_local_heads:
            return cache
        return cache[:, :, lo:lo + head_end - head_start]


class _PairWorker:
    """The thread that owns one pair channel: it opens it, then runs the side's loop (see the subclasses)."""

    def __init__(self, end: _Endpoint, name: str, channel: PairChannel, route: Route) -> None:
        self.end, self.name, self.channel, self.route = end, name, channel, route
        self.ready = threading.Event()
        self.broken: str | None = None
        self.seq = 0
        self._stopping = False
        self.thread = threading.Thread(target=self._main, name=f"kv-{end.role}-{name}", daemon=True)
        self._stream = None
        self._layouts: OrderedDict[tuple, _Layout] = OrderedDict()

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        try:
            if self.end.device.type == "cuda":
                torch.cuda.set_device(self.end.device)
                self._stream = torch.cuda.Stream(self.end.device)
                # this thread's current stream from now on (streams are per thread): its own work needs no
                # stream switch per transfer (`_on_stream`), host time on the transfer's critical path
                torch.cuda.set_stream(self._stream)
            self.channel.open()
        except Exception as exc:
            self._break(str(exc))
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except Exception as exc:  # a bug or a device error: never leave an op TRANSFERRING with no thread
            self._break(f"internal: {type(exc).__name__}: {exc}")
            self.end._fail_unsettled(self.name, f"internal: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stopping = True

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            self.channel.abort()
        self.end._peer_broken(self.name, why)

    def _fail(self, ops: Sequence[_Op], exc: BaseException) -> None:
        """Mid-payload (wire or device error): the pair is out of step now; the ops end FAILED."""
        if not isinstance(exc, TransferError):
            exc = TransferError("internal", f"{type(exc).__name__}: {exc}")
        self._break(str(exc))
        for op in ops:
            self.end._finish(op, TransferState.FAILED, str(exc))

    def _on_stream(self):
        if self._stream is None or threading.current_thread() is self.thread:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()  # the caller's thread may have another current device
        stack.enter_context(torch.cuda.device(self.end.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def _settle_stream(self, deadline: float) -> None:
        """CUDA: wait (keeping the deadline) until the side stream ran everything queued so far."""
        if self._stream is None:
            return
        ev = torch.cuda.Event()
        ev.record(self._stream)
        # a receive whose sender died or aborted never completes: the header stream's end says so at once
        poll_until(lambda: ev.query() or self.channel.check_peer("device copies"), deadline, "device copies")
        self.channel.check_aborted("device copies")  # our own abort also ends the copies (not with the bytes)

    def _layout(self, header: KVHeader) -> _Layout:
        """The chunk plan of a header and one copy plan per chunk (this end's cache views), kept for reuse: a
        request of the same page count and head range moves the same way (no table upload, no planning)."""
        key = (header.num_pages, header.head_start, header.head_end, header.index_layers, header.max_chunk_bytes)
        lay = self._layouts.get(key)
        if lay is not None:
            self._layouts.move_to_end(key)
            return lay
        pieces = header.pieces()
        page_bytes = [p[2] for p in pieces]
        chunks = plan_chunks(page_bytes, header.num_pages, header.max_chunk_bytes)
        plans = []
        with self._on_stream():
            for chunk in chunks:
                views = [self.end._cache_view(pieces[s.piece][0], pieces[s.piece][1], header.head_start,
                                              header.head_end) for s in chunk]
                plans.append(PageCopyPlan(views, header.num_pages, ranges=[(s.page_lo, s.page_hi) for s in chunk],
                                          offsets=[s.offset for s in chunk]))
        lay = _Layout(sizes=[chunk_nbytes(c, page_bytes) for c in chunks], plans=plans)
        self._layouts[key] = lay
        if len(self._layouts) > _LAYOUTS_KEPT:
            self._layouts.popitem(last=False)
        return lay


@dataclass(frozen=True)


class _Layout:
    sizes: list[int]  # bytes of each chunk (= message)
    plans: list[PageCopyPlan]  # one gather/scatter launch per chunk
