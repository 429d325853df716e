"""The receiving end: `KVReceiver` and the per-pair worker that reads headers and scatters chunks into pages."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from workers.kv.config import TransferState, _CLOSE, _HEADER_VERSION
from workers.kv.endpoint import _Endpoint, _Op, _PairWorker
from workers.kv.transport import TransferError, TransferTimeout
from workers.kv.wire import KVHeader, _decode_trailer, _encode_statuses, _words_sum, header_chunk_sizes


class _RecvWorker(_PairWorker):
    """Blocks on the pair's header stream for the next header; then posts the chunk receives, one scatter launch
    per chunk (stream-ordered behind its receive on NCCL: no CPU wait until everything is queued), settles, and
    answers with the status over the backend."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._ok: dict[int, torch.Tensor] = {}  # all-ok status per payload size (requests), see _ok_status
        self._decoded = 0.0  # when the current payload's header was decoded (a phase mark)

    def stop(self) -> None:
        super().stop()
        self.channel.wake()

    def _loop(self) -> None:
        cfg = self.end.config
        while not self._stopping:
            try:
                raw = self.channel.next_header(cfg.idle_wait_s)
            except TransferTimeout:
                continue
            except TransferError as exc:
                self._break("closed" if self._stopping else str(exc))
                return
            arrived = time.monotonic()
            if raw == _CLOSE:
                self._break("closed")
                return
            try:
                header = KVHeader.decode(raw)
            except ValueError as exc:  # the payload size is unknown: cannot stay in step
                self._break(str(exc))
                return
            self.seq += 1
            self._decoded = time.monotonic()
            if not self._receive(header, arrived):
                return

    def _claim(self, request_id: str, num_pages: int, problem: str | None) -> tuple[_Op | None, str | None]:
        """Find the PENDING op of one request of a payload and mark it TRANSFERRING; else say why not.
        `problem`: the payload's own mismatch (it refuses every request in it)."""
        end = self.end
        with end._cond:
            end._expire()
            op = end._ops.get(request_id, {}).get(self.name)
            if op is None or op.state is not TransferState.PENDING:
                why = "not prepared" if op is None else f"{op.state.value} ({op.reason})"
                return None, f"unknown request {request_id!r} on this pair: {why}"
            op.state, op.started = TransferState.TRANSFERRING, time.monotonic()
            end._cond.notify_all()
        if problem is None and op.page_ids.numel() != num_pages:
            problem = f"header mismatch: num_pages {num_pages!r} != {op.page_ids.numel()!r}"
        return op, problem

    def _mismatch(self, h: KVHeader) -> str | None:
        """What about the payload as a whole differs from this pair's end (every request in it is refused)."""
        end, r = self.end, self.route
        want = {
            "version": _HEADER_VERSION, "num_layers": end.kv.num_layers,
            "page_size": end.kv.page_size, "head_start": r.head_start, "head_end": r.head_end,
            "head_dim": end.kv.k[0].shape[3], "dtype": str(end.dtype),
            "index_layers": end.index_layers if r.with_index else (),
        }
        if r.with_index and end.index_layers:
            want["index_dim"] = end.kv.index_k[end.index_layers[0]].shape[2]
        bad = [f"{k} {getattr(h, k)!r} != {v!r}" for k, v in want.items() if getattr(h, k) != v]
        return f"header mismatch: {', '.join(bad)}" if bad else None

    def _receive(self, header: KVHeader, arrived: float) -> bool:
        """Take one payload (one request, or a batch) and answer it; returns False when the pair broke. The first
        receives are posted before the header is checked (their sizes follow from the header alone): the bytes
        move meanwhile. A refused request's part is not written (page id -1 in the scatter; a payload refused
        whole is drained into the scratch buffers), so the pair stays in step."""
        cfg = self.end.config
        deadline = arrived + cfg.timeout_s
        sizes = header_chunk_sizes(header)
        items = header.items()
        tag = "|".join(rid for rid, _n, _m in items)
        claims: list[tuple[_Op | None, str | None]] = []
        withdrawn: set[int] = set()
        try:
            with self._on_stream():
                pending = deque(self._post_recv(i, n, tag) for i, n in enumerate(sizes[:cfg.max_inflight_chunks]))
                recv0 = time.monotonic()
                whole = self._mismatch(header)
                claims = [self._claim(rid, n, whole) for rid, n, _m in items]
                claimed = time.monotonic()
                for (op, problem), (_rid, n, meta) in zip(claims, items):
                    if op is not None:
                        op.num_bytes = n * header.page_bytes()
                        op.meta = meta if problem is None else None
                        op.marks.update(header=arrived, decoded=self._decoded, recv0=recv0, claimed=claimed)
                ids, plans = self._landing_pages(header, claims)
                sums = sent = None
                if header.checksum:
                    sums = torch.empty(len(sizes), dtype=torch.int64, device=self.end.device)
                    sent = torch.empty(len(sizes), dtype=torch.int64, device=self.end.device)
                next_chunk = len(pending)
                while pending:
                    self._land(*pending.popleft(), ids, plans, sums, deadline)
                    if next_chunk < len(sizes):
                        pending.append(self._post_recv(next_chunk, sizes[next_chunk], tag))
                        next_chunk += 1
                if header.checksum:
                    self.channel.order_after(self.channel.recv(sent, tag=tag), deadline, "recv")
                posted = time.monotonic()
                for op, _problem in claims:
                    if op is not None:
                        op.marks["posted"] = posted
                self._settle_stream(deadline)
                if header.announced:  # each request's meta, or withdrawn, follows its pages
                    claims, withdrawn = self._read_trailer(claims, deadline, tag)
                if header.checksum and not torch.equal(sums, sent):
                    bad = f"checksum mismatch: sent {sent.tolist()} received {sums.tolist()}"
                    claims = [(op, problem or bad) for op, problem in claims]
        except Exception as exc:  # mid-payload (wire or device error): the pair is out of step now
            ops = [op for op, _problem in claims if op is not None]
            if ops:
                self._fail(ops, exc)
            else:
                self._break(str(exc) if isinstance(exc, TransferError) else f"internal: {exc}")
            return False
        answers = []
        landed = time.monotonic()
        for k, (op, problem) in enumerate(claims):
            ok, reason = problem is None, problem
            if k in withdrawn:
                answers.append((False, problem))
                if op is not None:
                    self._unclaim(op)
                continue
            if op is not None:
                op.marks["landed"] = landed
                with self.end._cond:
                    if op.aborted:
                        ok, reason = False, "aborted on the receiving side"
                self.end._finish(op, TransferState.DONE if problem is None else TransferState.FAILED, problem)
            answers.append((ok, reason))
        try:
            with self._on_stream():
                if all(ok for ok, _reason in answers):
                    status = self._ok_status(len(answers))
                else:
                    status = _encode_statuses(answers, self.end.device)
                self.channel.wait_work(self.channel.send(status, tag=tag), deadline, "status")
        except TransferError as exc:
            self._break(str(exc))
            return False
        return True

    def _read_trailer(self, claims: list, deadline: float, tag: str) -> tuple[list, set[int]]:
        """After an announced payload's pages: the trailer with each request's meta. A withdrawn request's
        claim gets a problem (the sender is answered so) and its index is returned: it goes back to waiting.
        TransferError when no trailer (of this payload) comes: the pair is out of step."""
        try:
            raw = self.channel.next_header(max(0.0, deadline - time.monotonic()), tag=tag)
            metas, withdrawn = _decode_trailer(raw, len(claims))
        except ValueError as exc:
            raise TransferError("internal", str(exc)) from None
        out = []
        for k, ((op, problem), meta) in enumerate(zip(claims, metas)):
            if k in withdrawn:
                problem = "withdrawn by the sender"
            elif op is not None and problem is None:
                op.meta = meta
            out.append((op, problem))
        return out, withdrawn

    def _unclaim(self, op: _Op) -> None:
        """A withdrawn request: PENDING again (as if nothing had come; its pages' contents are undefined), or
        FAILED if it was aborted meanwhile."""
        with self.end._cond:
            if op.aborted:
                op.state, op.reason, op.finished = TransferState.FAILED, "aborted", time.monotonic()
            else:
                op.state, op.started, op.meta = TransferState.PENDING, None, None
                op.marks.clear()
            self.end._cond.notify_all()
        self.end._notify()

    def _landing_pages(self, header: KVHeader, claims: list) -> tuple[torch.Tensor | None, list | None]:
        """(page ids the payload's pages land in, the scatter plans), or (None, None) when nothing is accepted
        (the payload is drained). A batch with refused requests gets page id -1 for their pages (not written)."""
        accepted = [op is not None and problem is None for op, problem in claims]
        if not any(accepted):
            return None, None
        plans = self._layout(header).plans
        if len(claims) == 1:
            return claims[0][0].page_ids, plans
        parts = [op.page_ids if ok else torch.full((n,), -1, dtype=torch.int64, device=self.end.device)
                 for (op, _p), ok, (_rid, n, _m) in zip(claims, accepted, header.items())]
        return torch.cat(parts), plans

    def _post_recv(self, i: int, nbytes: int, tag: str) -> tuple[int, torch.Tensor, Any]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.end.device)
        return i, buf, self.channel.recv(buf, tag=tag)

    def _ok_status(self, n: int) -> torch.Tensor:
        """The answer to a good payload of `n` requests, built once per `n` (no host-to-device copy per transfer:
        a prefill step's batch sizes repeat). Only ever read by the backend's send, so sharing it between
        transfers of this pair is safe."""
        status = self._ok.get(n)
        if status is None:
            status = self._ok[n] = _encode_statuses([(True, None)] * n, self.end.device)
        return status

    def _land(self, i: int, buf: torch.Tensor, work, ids: torch.Tensor | None, plans, sums,
              deadline: float) -> None:
        """Scatter received chunk i into the prepared pages (unless refused), ordered after its receive: one
        launch, queued on the copy stream without waiting for the bytes on NCCL."""
        self.channel.order_after(work, deadline, "recv")
        if sums is not None:
            sums[i] = _words_sum(buf)
        if plans is not None:
            plans[i].scatter(ids, buf)


class KVReceiver(_Endpoint):
    """The decode shard's end. `prepare_receive(request_id, page_ids)` admits a request's KV into pages the
    decode engine allocated; `wait(request_id)` / `state(request_id)` tell when it landed (DONE) or why not."""

    role = "receiver"

    def _worker_class(self) -> type:
        return _RecvWorker

    def prepare_receive(self, request_id: str, page_ids: Sequence[int] | torch.Tensor, *,
                        peers: Sequence[str] | None = None) -> None:
        """Expect the request's KV from every pair (or the given `peers`: the routes of one prefill group)."""
        self._register(request_id, page_ids, peers)

    def _expire(self) -> None:
        now = time.monotonic()
        for ops in self._ops.values():
            for op in ops.values():
                if op.state is TransferState.PENDING and now - op.created > self.config.receive_timeout_s:
                    op.state, op.finished = TransferState.FAILED, now
                    op.reason = f"timeout: no KV arrived within {self.config.receive_timeout_s:g} s"
