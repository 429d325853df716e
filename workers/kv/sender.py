"""The sending end: `KVSender` and the per-pair worker that gathers pages into chunks and sends them."""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workers.kv.config import TransferState, _CLOSE, _STATUS_BYTES
from workers.kv.endpoint import _Endpoint, _Layout, _Op, _PairWorker, _mark
from workers.kv.transport import TransferError
from workers.kv.wire import KVHeader, _decode_statuses, _encode_trailer, _words_sum


@dataclass(kw_only=True)
class _Flight:
    """One payload on one pair (one request, or a batch of them), posted (or being posted) by the sender."""

    ops: list[_Op]  # in payload order
    tag: str  # the requests' ids joined by "|" (what the channel sees; FaultyChannel keys on the ids in it)
    page_ids: torch.Tensor  # [total pages] int64 on the device: every op's pages, back to back
    layout: _Layout
    deadline: float
    checksum: bool
    next_chunk: int = 0
    sends: deque = field(default_factory=deque)  # (work, staging buffer) not known complete yet
    sums: torch.Tensor | None = None  # [chunks] int64 on the device, when checksums travel
    sums_posted: bool = False
    ack: tuple | None = None  # (work, status buffer): the receiver's answer, posted after the payload
    announced: bool = False  # its header went ahead (`announce`): a trailer follows the pages
    expired: bool = False  # announced, pages not released in time: sent withdrawn with stand-in ops
    trailer_posted: bool = False


class _Slot:
    """A transfer the caller's thread posted (None: it ended while posting), for the pair's thread to complete.
    An announced one (`go` not None) had only its header posted: the pair's thread waits for `go` (its pages
    posted by `release`) before completing it, and every later transfer waits behind it."""

    def __init__(self, *, waiting: set[str] | None = None) -> None:
        self.flight: _Flight | None = None
        self.waiting = waiting or set()  # announced: request ids whose pages are not released yet
        self.go = threading.Event() if waiting else None


class _SendWorker(_PairWorker):
    """Posting happens in the caller's thread when the pair is idle (`submit`: header, gathers, sends, the status
    receive; no thread hand-off before the bytes move); the pair's thread then waits for the status and settles
    the op, and it posts whatever arrives while the pair is busy, in order, or chunks beyond the in-flight cap."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.queue: queue.Queue = queue.Queue()  # _Op to post, _Slot being posted by a caller, None = stop
        self._lock = threading.Lock()
        self._active = 0  # items submitted and not finished: posting inline is only allowed when 0
        self._announced: _Slot | None = None  # the announced payload whose pages are not all released yet
        self._pinned_ids: torch.Tensor | None = None  # CUDA: the gathers' page ids (see _page_ids_for_gather)

    def stop(self) -> None:
        super().stop()
        self.queue.put(None)

    def submit(self, ops: list[_Op]) -> None:
        """Post `ops` (one request, or several sent as one payload) now if the pair is idle, else queue them."""
        _mark(ops, "called")
        with self._lock:
            self._active += 1
            if not (self._active == 1 and self.ready.is_set() and self.broken is None):
                self.queue.put(ops)
                return
            # posted under the lock and queued after it: the pair's thread wakes once the bytes are on their way,
            # not in the middle of the posting (where it would take the GIL from us), and a concurrent submit
            # queues behind this transfer
            slot = _Slot()
            try:
                slot.flight = self._post(ops)
            finally:
                self.queue.put(slot)

    def announce(self, ops: list[_Op]) -> bool:
        """Post the header of `ops` (one payload) now, ahead of their pages (`release` posts those): only when
        the pair is idle. False (nothing done) when it is busy: the ops then go the ordinary way."""
        with self._lock:
            if not (self._active == 0 and self.ready.is_set() and self.broken is None and ops):
                return False
            self._active += 1
            slot = _Slot(waiting={op.request_id for op in ops})
            try:
                slot.flight = self._open(ops, announced=True)
            finally:
                if slot.flight is None:  # failed while posting (the ops ended FAILED): nothing will follow
                    slot.go.set()
                else:
                    self._announced = slot
                self.queue.put(slot)
            return True

    def release(self, ops: list[_Op]) -> list[_Op]:
        """The pages of these announced ops are ready (their meta set) or withdrawn: once no op of the announced
        payload is left waiting, post its pages and trailer from the caller's thread. Returns the ops that are
        not in that payload (the pair was busy when they were announced)."""
        with self._lock:
            slot = self._announced
            mine = [op for op in ops if slot is not None and op.request_id in slot.waiting]
            if not mine:
                return list(ops)
            slot.waiting.difference_update(op.request_id for op in mine)
            if not slot.waiting:
                self._announced = None
                try:
                    slot.flight = self._post_data(slot.flight)
                finally:
                    slot.go.set()
        return [op for op in ops if op not in mine]

    def _await_go(self, slot: _Slot) -> None:
        """The pair's thread, at an announced payload: wait until its pages are posted. At `announce_wait_s`
        the payload goes out as withdrawn instead (`_expire_announced`); at a stop it is given up and the pair
        broken (the receiver waits on receives that no send will match)."""
        cfg = self.end.config  # well inside the receiver's deadline, which runs from the header too
        expire = time.monotonic() + min(cfg.announce_wait_s, 0.5 * cfg.timeout_s)
        while not slot.go.wait(0.02):
            now = time.monotonic()
            if not (self._stopping or now > expire):
                continue
            with self._lock:
                if slot.go.is_set():
                    return
                self._announced, flight = None, slot.flight
                if not self._stopping:
                    slot.flight = self._expire_announced(flight, slot.waiting)
                    slot.go.set()
                    return
                slot.flight = None
                slot.go.set()
            self._fail(flight.ops, TransferError("internal", "stopped with an announced payload unsent"))
            return

    def _expire_announced(self, flight: _Flight, waiting: set[str]) -> _Flight | None:
        """(Pair lock held.) Send an announced payload whose pages did not all come in time as withdrawn
        (stand-in ops: the receiver's receives are matched and it forgets the requests) and put its requests
        back to PENDING, no longer announced on this pair: `send_many` sends those still `waiting` as an
        ordinary payload, and the ones it already released are queued so now (withdrawn ones end here)."""
        stand_ins = [dataclasses.replace(op, withdrawn=True, marks={}, started=None) for op in flight.ops]
        with self.end._cond:
            for op in flight.ops:
                if op.state is TransferState.TRANSFERRING:
                    op.state, op.started = TransferState.PENDING, None
            self.end._cond.notify_all()
        released = [op for op in flight.ops if op.request_id not in waiting]
        for op in released:
            if op.withdrawn:
                self.end._finish(op, TransferState.FAILED, "withdrawn by the sender")
        again = [op for op in released if not op.withdrawn]
        if again:
            self._active += 1
            self.queue.put(again)  # right behind this payload
        flight.ops, flight.expired = stand_ins, True
        return self._post_data(flight)

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                if not self.broken:
                    with contextlib.suppress(TransferError):
                        self.channel.post_header(_CLOSE)
                return
            try:
                if isinstance(item, _Slot):
                    if item.go is not None:
                        self._await_go(item)
                    flight = item.flight
                else:
                    flight = self._post(item)
                if flight is not None:
                    self._complete(flight)
            finally:
                with self._lock:
                    self._active -= 1

    def _header(self, ops: list[_Op], announced: bool) -> KVHeader:
        r, end, op = self.route, self.end, ops[0]
        batch = (tuple((o.request_id, o.page_ids.numel(), None if announced else o.meta) for o in ops)
                 if len(ops) > 1 else ())
        return KVHeader(request_id=op.request_id, num_pages=sum(o.page_ids.numel() for o in ops),
                        num_layers=end.kv.num_layers,
                        page_size=end.kv.page_size, head_start=r.head_start, head_end=r.head_end,
                        head_dim=end.kv.k[0].shape[3],
                        index_dim=(end.kv.index_k[end.index_layers[0]].shape[2]
                                   if r.with_index and end.index_layers else 0),
                        index_layers=end.index_layers if r.with_index else (), dtype=str(end.dtype),
                        element_size=end.kv.k[0].element_size(), max_chunk_bytes=end.config.max_chunk_bytes,
                        checksum=end.config.verify_checksum, meta=None if batch or announced else op.meta,
                        batch=batch, announced=announced)

    def _post(self, ops: list[_Op]) -> _Flight | None:
        """Header, then the first chunks (up to the in-flight cap) and, when they are all, the status receive.
        The ops still PENDING go as one payload (those aborted while queued are left out). Returns None when
        nothing is left to send (all aborted, broken pair, a failure while posting)."""
        flight = self._open(ops, announced=False)
        return None if flight is None else self._post_data(flight)

    def _open(self, ops: list[_Op], *, announced: bool) -> _Flight | None:
        """Post the header of the ops still PENDING (TRANSFERRING from here) and upload their page ids; None when
        nothing is left to send (see `_post`). `announced`: the header goes ahead of the pages and says so."""
        now = time.monotonic()
        with self.end._cond:
            ops = [op for op in ops if op.state is TransferState.PENDING]  # not aborted while queued / failed fast
            for op in ops:
                op.state, op.started = TransferState.TRANSFERRING, now
            self.end._cond.notify_all()
        if not ops:
            return None
        if self.broken:
            for op in ops:
                self.end._finish(op, TransferState.FAILED, f"pair_broken: {self.broken}")
            return None
        cfg = self.end.config
        tag = "|".join(op.request_id for op in ops)
        try:
            header = self._header(ops, announced)
            layout = self._layout(header)
            raw = header.encode()
        except Exception as exc:
            self._fail(ops, exc)
            return None
        _mark(ops, "encoded")
        try:
            self.channel.post_header(raw, tag=tag)
        except TransferError as exc:  # nothing was posted: the peer is gone
            self._fail(ops, exc)
            return None
        self.seq += 1
        sent = time.monotonic()
        for op in ops:
            op.num_bytes = op.page_ids.numel() * header.page_bytes()
            op.marks["header"] = sent
        host_ids = ops[0].page_ids if len(ops) == 1 else torch.cat([op.page_ids for op in ops])
        return _Flight(ops=ops, tag=tag, page_ids=host_ids, layout=layout, deadline=now + cfg.timeout_s,
                       checksum=header.checksum, announced=announced)

    def _post_data(self, flight: _Flight) -> _Flight | None:
        """The pages of an opened payload: the first chunks and, once they are all posted, an announced one's
        trailer (each request's meta, or withdrawn) and the status receive. None after a failure."""
        ops = flight.ops  # the deadline still runs from the header (as the receiver's does)
        try:
            with self._on_stream():
                flight.page_ids = self._page_ids_for_gather(flight.page_ids)
                _mark(ops, "uploaded")
                ready = next((op.ready_event for op in ops if op.ready_event is not None), None)
                if ready is not None:  # the pages were written on the caller's stream
                    self._stream.wait_event(ready)
                if flight.checksum:
                    flight.sums = torch.empty(len(flight.layout.sizes), dtype=torch.int64, device=self.end.device)
                self._post_chunks(flight, block=False)
        except Exception as exc:
            self._fail(ops, exc)
            return None
        posted = time.monotonic()
        for op in ops:
            op.marks["posted"] = posted
        return flight

    def _page_ids_for_gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The payload's page ids where the gather kernel reads them. CUDA: copied into this pair's pinned host
        buffer, which the kernel reads over the bus (an upload cost ~0.09 ms of host time on the H200 host, on
        the critical path; docs/benchmarks.md, KV transfer, session 5). Reusing the buffer is safe: a pair
        moves one payload at a time, and the next starts only after the receiver's status, which follows every
        receive of this one (so every gather that read the ids has run)."""
        if self.end.device.type != "cuda":
            return ids
        n = ids.numel()
        if self._pinned_ids is None or self._pinned_ids.numel() < n:
            self._pinned_ids = torch.empty(max(n, 1024), dtype=torch.int64).pin_memory()
        out = self._pinned_ids[:n]
        out.copy_(ids)
        return out

    def _gather(self, flight: _Flight, i: int) -> torch.Tensor:
        """Chunk i of the payload in one new staging buffer (uint8 [nbytes]): one copy launch on CUDA."""
        buf = torch.empty(flight.layout.sizes[i], dtype=torch.uint8, device=self.end.device)
        if i == 0:
            _mark(flight.ops, "staged")
        flight.layout.plans[i].gather(flight.page_ids, buf)
        return buf

    def _post_chunks(self, flight: _Flight, *, block: bool) -> None:
        """Post the next chunks; at the in-flight cap stop (block=False) or wait for the oldest send (True).
        After the last chunk: the checksums (if any), then the status receive."""
        cfg, n = self.end.config, len(flight.layout.sizes)
        rid = flight.tag
        while flight.next_chunk < n:
            if len(flight.sends) >= cfg.max_inflight_chunks:
                if not block:
                    return
                self.channel.wait_work(flight.sends.popleft()[0], flight.deadline, "send")
            i = flight.next_chunk
            buf = self._gather(flight, i)
            if i == 0:
                _mark(flight.ops, "gather0")
            if flight.checksum:
                flight.sums[i] = _words_sum(buf)
            flight.sends.append((self.channel.send(buf, tag=rid), buf))
            flight.next_chunk += 1
            if i == 0:
                _mark(flight.ops, "send0")
        if flight.checksum and not flight.sums_posted:
            flight.sends.append((self.channel.send(flight.sums, tag=rid), flight.sums))
            flight.sums_posted = True
        if flight.announced and not flight.trailer_posted:  # the receiver answers only once it read it
            self.channel.post_header(_encode_trailer(flight.ops), tag=rid)
            flight.trailer_posted = True
        if flight.ack is None:
            status = torch.empty(_STATUS_BYTES * len(flight.ops), dtype=torch.uint8, device=self.end.device)
            flight.ack = (self.channel.recv(status, tag=rid), status)

    def _complete(self, flight: _Flight) -> None:
        """Post what is left, wait for the receiver's status (it implies the sends completed), settle each op."""
        try:
            with self._on_stream():
                if flight.ack is None:
                    self._post_chunks(flight, block=True)
                work, status = flight.ack
                # the peer's own timeout acts first on a silent payload; its closing then reads as our timeout
                self.channel.wait_work(work, flight.deadline, "status", grace_s=self._grace())
                answers = _decode_statuses(status, len(flight.ops))
            acked = time.monotonic()
            while flight.sends:
                self.channel.wait_work(flight.sends.popleft()[0], flight.deadline, "send")
        except Exception as exc:
            self._fail(flight.ops, exc)
            return
        if flight.expired:  # stand-ins: the real requests were put back to PENDING
            return
        for op, (ok, reason) in zip(flight.ops, answers):
            op.marks["acked"] = acked
            if ok:
                self.end._finish(op, TransferState.DONE)
            else:  # the receiver refused the header or the data; it drained that part, the pair is still usable
                self.end._finish(op, TransferState.FAILED, f"rejected by receiver: {reason}")

    def _grace(self) -> float:
        # covers the header's trip through the store (the receiver's deadline starts when it reads the header),
        # also on a loaded host; gloo only (NCCL polls our own deadline exactly)
        return min(10.0, max(1.0, 0.5 * self.end.config.timeout_s))


class KVSender(_Endpoint):
    """The prefill shard's end. `send(request_id, page_ids)` posts the request on each of its pairs (or the
    given `peers`) from the caller's thread when the pair is idle, else queues it behind the pair's transfers;
    the pages must stay allocated until `wait(request_id).settled`."""

    role = "sender"

    def _worker_class(self) -> type:
        return _SendWorker

    def send(self, request_id: str, page_ids: Sequence[int] | torch.Tensor, *,
             peers: Sequence[str] | None = None, meta: dict | None = None) -> None:
        """`meta`: a small JSON-able dict that travels in the header; the receiver's result shows it."""
        self.send_many([(request_id, page_ids, meta)], peers=peers)

    def send_many(self, items: Sequence[tuple[str, Sequence[int] | torch.Tensor, dict | None]], *,
                  peers: Sequence[str] | None = None, withdrawn: Sequence[str] = ()) -> None:
        """Send several requests (request id, page ids, meta) down each pair as one payload: one header, their
        pages back to back, one status with an answer per request. What a prefill step that finished several
        prompts sends: one transfer's fixed costs (header, posts, launches, the status round trip) instead of one
        per request, which on a pair queue behind each other. Each request keeps its own state and result.

        Requests `announce`d before go with their announced payload (their page ids and `peers` are the
        announced ones); `withdrawn`: announced requests that will not be sent after all (the first token ended
        them). Their bytes still travel (a receiver's receives are posted), and the receiver forgets them; their
        result here ends FAILED ("withdrawn"). An announced payload goes once none of its requests is waiting."""
        with self._cond:  # checked before anything is registered or marked
            fresh = [it for it in items if it[0] not in self._ops]
            known = [it for it in items if it[0] in self._ops]
            later = [self._announced_ops(rid) for rid, _ids, _m in known]
            gone = [self._announced_ops(rid) for rid in withdrawn]
        per_request = self._register_many([(rid, ids) for rid, ids, _m in fresh], peers)
        for ops, (_rid, _ids, meta) in zip(per_request, fresh):
            for op in ops.values():
                op.meta = meta
        now = time.monotonic()
        with self._cond:
            for ops, (_rid, _ids, meta) in zip(later, known):
                for op in ops.values():
                    op.meta, op.released, op.marks["called"] = meta, True, now
            for ops in gone:
                for op in ops.values():
                    op.withdrawn = op.released = True
        ready = None
        if self.device.type == "cuda":  # the copy stream must see the prefill's writes to these pages
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        by_peer: dict[str, tuple[list[_Op], list[_Op]]] = {}  # peer -> (announced ops, new ops)
        for ops in [*later, *gone]:
            for name, op in ops.items():
                op.ready_event = ready
                by_peer.setdefault(name, ([], []))[0].append(op)
        for ops in per_request:
            for name, op in ops.items():
                op.ready_event = ready
                by_peer.setdefault(name, ([], []))[1].append(op)
        for name, (announced, new) in by_peer.items():
            rest = self._workers[name].release(announced) if announced else []
            for op in rest:  # announced while the pair was busy: nothing went ahead of them
                if op.withdrawn:
                    self._finish(op, TransferState.FAILED, "withdrawn by the sender")
            queued = [op for op in rest if not op.withdrawn] + new
            if queued:
                self._workers[name].submit(queued)

    def announce(self, items: Sequence[tuple[str, Sequence[int] | torch.Tensor]], *,
                 peers: Sequence[str] | None = None) -> None:
        """Send the header of requests (request id, page ids) whose pages are still being written (a prefill
        step's forward), so the receiver posts its receives meanwhile; `send_many` (or its `withdrawn`) must
        follow for every one of them, soon (a pair waits for it, at most the transfer timeout, then breaks). On
        a pair that is busy nothing goes ahead: those requests are sent the ordinary way by `send_many`."""
        per_request = self._register_many(list(items), peers)
        now = time.monotonic()
        for ops in per_request:
            for op in ops.values():
                op.announced, op.marks["announced"] = True, now
        if not per_request:
            return
        for name in per_request[0]:
            ops = [r[name] for r in per_request if r[name].state is TransferState.PENDING]
            self._workers[name].announce(ops)

    def _announced_ops(self, request_id: str) -> dict[str, _Op]:
        ops = self._ops.get(request_id, {})
        if not ops:
            raise ValueError(f"withdrawn: {request_id!r} was not announced on this sender")
        if not all(op.announced for op in ops.values()):
            raise ValueError(f"request_id: {request_id!r} already has a transfer on this sender")
        if any(op.released for op in ops.values()):
            raise ValueError(f"request_id: {request_id!r} was sent or withdrawn already")
        return ops

    def _register_many(self, items: Sequence[tuple[str, Sequence[int] | torch.Tensor]],
                       peers: Sequence[str] | None) -> list[dict[str, _Op]]:
        """One op per peer for each request (page ids stay on the host until a header left); all or none."""
        per_request: list[dict[str, _Op]] = []
        try:
            for request_id, page_ids in items:
                per_request.append(self._register(request_id, page_ids, peers, upload=False))
        except ValueError:
            with self._cond:  # none of them was submitted: forget the ones registered
                for ops in per_request:
                    self._ops.pop(next(iter(ops.values())).request_id, None)
            raise
        return per_request
