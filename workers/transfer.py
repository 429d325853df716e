"""KV transfer between a prefill shard and a decode shard: `KVSender` / `KVReceiver` (DESIGN.md §4).

What travels, for one request: its pages of every layer, K and V (the KV-head range the route assigns) and the
index-K of sparse layers (one head, replicated on every tp rank, so exactly one route per receiving shard carries
it). Pages are matched by position: page `page_ids[i]` on the sender lands in `page_ids[i]` on the receiver.

How it travels, per request and pair (posted in one order on both sides, so messages of different requests
never interleave):
  1. sender: header (JSON: request id, page count, layers, head range, dims, dtype, chunk cap) -> the pair's
     header stream (workers/transport.py; the receiving pair thread is already blocked reading it)
  2. sender: gathers the pages of all layers and both families into a few contiguous staging buffers, each at
     most `max_chunk_bytes` (one large message moves ~15x faster than 1 MiB ones on NCCL, PERF.md), with ONE copy
     launch per chunk (kernels.page_copy; on CUDA it reads the page ids from the pair's pinned host buffer),
     sends them point-to-point right behind the header (on GPU our own NCCL calls, workers/nccl.py) and posts the
     receive of the status; all of it from the caller's thread when the pair is idle (no thread hand-off before
     the bytes move). Receiver: reads the header, posts the first receives (their sizes follow from the header),
     then checks the header against what it prepared, and scatters each chunk into its own page ids (one launch
     per chunk, queued behind the receive on the copy stream).
  3. receiver: status (ok / reason, a 512-byte tensor) -> sender over the backend; the sender's pair thread sees
     it and the sender's op is DONE.
Several requests finished by one prefill step go as one payload (`send_many`: one header listing them, their
pages back to back, one status each). An *announced* payload (`announce`, TransferConfig.announce) splits step 1
from step 2: the header goes while the pages are still being written, and after the pages a trailer on the
header stream carries each request's meta or says the sender withdrew it (the receiver reads it before answering).
A header that does not match (unknown or aborted request, wrong page count, head range, dims or dtype) is not
an error of the wire: the receiver drains the payload into scratch memory, so the pair stays in step, and both
sides end FAILED with the reason. A timeout or a dead peer in the middle of a payload breaks the pair: the
operation and every later one on that pair end FAILED ("pair_broken"), the other side learns it from the header
stream's end (transport.PairChannel.abort), and the wiring layer makes a new pair.

States (`TransferState`): PENDING (prepared / queued) -> TRANSFERRING (header sent / received) -> DONE | FAILED.
Pages may be freed (both sides) once a request is *settled*: every pair operation of it is DONE or FAILED.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.page_copy import PageCopyPlan
from msa.kv_cache import KVCache
from workers.stats import TransferStats
from workers.transport import PairChannel, PeerGone, TransferError, TransferTimeout, poll_until

_CLOSE = b"__close__"
# 2: `meta` (the first token) and `batch` (several requests per payload, one status each) joined the header;
# 3: `announced` (the header goes ahead of the pages; each request's meta follows them in a trailer)
_HEADER_VERSION = 3
_STATUS_BYTES = 512  # the receiver's answer: one small message on the backend (reason text included)
_STATUS_OK, _STATUS_REFUSED = 0x4F, 0x52
_LAYOUTS_KEPT = 32  # chunk/copy plans kept per pair (one per page count seen recently)


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """Knobs of the transfer engine (timeouts in seconds)."""

    timeout_s: float = 30.0  # one transfer, from its header to its status
    receive_timeout_s: float = 600.0  # how long a prepared receive waits for its header (prefill queue + compute)
    connect_timeout_s: float = 120.0  # building a pair (both sides must join)
    idle_wait_s: float = 300.0  # a receiving worker re-arms its header wait this often
    max_chunk_bytes: int = 64 * 2**20  # staging buffer (= message) size cap
    max_inflight_chunks: int = 4  # staging buffers alive at once per pair (bounds staging memory)
    verify_checksum: bool = False  # sum the staged words on both sides (costs one extra read of the payload)
    # the engines' side (disaggregation): pages a prefill engine holds for a transfer, or a decode engine reserved
    # for one, are freed when nothing settles or continues the request within this many seconds
    lease_s: float = 60.0
    # a prefill engine posts the header of the requests whose prompt completes in a step before that step's
    # forward (`KVSender.announce`): the receiver's receives are posted while the prefill computes, so after it
    # only the copies and the wire remain; the decode GPU holds a waiting receive for one prefill step. Off by
    # default: on 2 x H200 it did not shorten the transfer and the waiting receive raised decode's TPOT p99
    # (docs/benchmarks.md, "KV transfer", session 4)
    announce: bool = False
    # an announced payload whose pages are not released within this long (a forward that compiles kernels, a
    # huge chunk) goes out as withdrawn (its bytes unused) and its requests go the ordinary way: it bounds how
    # long the decode GPU holds a waiting receive (capped at half the transfer timeout)
    announce_wait_s: float = 5.0
    # the GPU data plane: "direct" (our own ncclSend/ncclRecv calls, workers/nccl.py) or "torch"
    # (ProcessGroupNCCL, ~0.14 ms of host time per post on each side; docs/benchmarks.md, KV transfer, session 5)
    nccl: str = "direct"

    def __post_init__(self) -> None:
        for name in ("timeout_s", "receive_timeout_s", "connect_timeout_s", "idle_wait_s", "lease_s",
                     "announce_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if self.max_chunk_bytes < 1:
            raise ValueError("max_chunk_bytes: must be >= 1")
        if self.max_inflight_chunks < 1:
            raise ValueError("max_inflight_chunks: must be >= 1")
        if self.nccl not in ("direct", "torch"):
            raise ValueError(f"nccl: must be 'direct' or 'torch', got {self.nccl!r}")


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


# ---- which shard sends which KV heads to which shard (pure) ------------------------------------------------
def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) tp rank `rank` holds; the same split as msa.parallel.ParallelContext.kv_head_range
    (heads are replicated on tp / num_kv_heads consecutive ranks when tp > num_kv_heads)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank: {rank} is not a rank of tp={tp}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads: {num_kv_heads} does not split over tp={tp}")
        per = num_kv_heads // tp
        return rank * per, per
    if tp % num_kv_heads:
        raise ValueError(f"tp: {tp} must be a multiple of num_key_value_heads={num_kv_heads} to replicate")
    return rank // (tp // num_kv_heads), 1


@dataclass(frozen=True, kw_only=True)
class Route:
    """Sender tp rank `src` sends global KV heads [head_start, head_end) (and the index-K pages when
    `with_index`) to receiver tp rank `dst`."""

    src: int
    dst: int
    head_start: int
    head_end: int
    with_index: bool

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def plan_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[Route]:
    """Every receiver rank gets each of its KV heads from exactly one sender rank, and the index-K from exactly
    one (its first route). A head replicated on several sender ranks is taken from replica `dst % replicas`, so
    equal layouts map rank i -> rank i and no sender is picked for everything. Sorted by (dst, head_start)."""
    owners: list[list[int]] = [[] for _ in range(num_kv_heads)]
    for s in range(src_tp):
        first, count = kv_heads_of_rank(num_kv_heads, src_tp, s)
        for h in range(first, first + count):
            owners[h].append(s)
    routes: list[Route] = []
    for d in range(dst_tp):
        first, count = kv_heads_of_rank(num_kv_heads, dst_tp, d)
        picks = [(h, owners[h][d % len(owners[h])]) for h in range(first, first + count)]
        start = 0
        for i in range(1, len(picks) + 1):  # merge runs of consecutive heads taken from the same sender
            if i == len(picks) or picks[i][1] != picks[start][1]:
                routes.append(Route(src=picks[start][1], dst=d, head_start=picks[start][0],
                                    head_end=picks[i - 1][0] + 1, with_index=start == 0))
                start = i
    return routes


# ---- the header and the chunk plan (pure) -----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class KVHeader:
    """What a payload holds; both sides derive the identical chunk plan from it."""

    request_id: str
    num_pages: int
    num_layers: int
    page_size: int
    head_start: int
    head_end: int
    head_dim: int
    index_dim: int  # 0 when no index-K pages travel on this route
    index_layers: tuple[int, ...]  # layers whose index-K pages travel, ascending
    dtype: str  # e.g. "torch.bfloat16"
    element_size: int
    max_chunk_bytes: int
    checksum: bool
    version: int = _HEADER_VERSION
    # the caller's small JSON payload riding along (the first token and its logprobs, so the decode engine can
    # start when the pages land); not checked against the receiver's expectations
    meta: dict | None = None
    # several requests in one payload (their pages back to back, in this order): (request id, pages, meta) each;
    # empty for one request (request_id, num_pages, meta above). With a batch, num_pages is the total.
    batch: tuple = ()
    # sent ahead of the pages (`KVSender.announce`): no meta here; a trailer on the header stream follows the
    # payload with each request's meta, or says the sender withdrew it (its bytes are sent anyway, unused)
    announced: bool = False

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()  # tuples go as lists

    def items(self) -> list[tuple[str, int, dict | None]]:
        """(request id, pages, meta) of every request in the payload, in payload order."""
        return [tuple(e) for e in self.batch] if self.batch else [(self.request_id, self.num_pages, self.meta)]

    def page_bytes(self) -> int:
        """Payload bytes per page (all pieces)."""
        return sum(p[2] for p in self.pieces())

    @classmethod
    def decode(cls, raw: bytes) -> KVHeader:
        try:
            d = json.loads(raw)
            d["index_layers"] = tuple(d["index_layers"])
            d["batch"] = tuple(tuple(e) for e in d.get("batch", ()))
            return cls(**d)
        except Exception as exc:
            raise ValueError(f"undecodable KV header {raw[:120]!r}: {exc}") from exc

    def pieces(self) -> list[tuple[str, int, int]]:
        """(family, layer, bytes of one page) in payload order: per layer K, V, then index-K if it travels."""
        kv_page = self.page_size * (self.head_end - self.head_start) * self.head_dim * self.element_size
        out = []
        for layer in range(self.num_layers):
            out += [("k", layer, kv_page), ("v", layer, kv_page)]
            if layer in self.index_layers:
                out.append(("i", layer, self.page_size * self.index_dim * self.element_size))
        return out

    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes()


@dataclass(frozen=True)
class Segment:
    """Pages [page_lo, page_hi) of payload piece `piece`, at byte `offset` of its chunk."""

    piece: int
    page_lo: int
    page_hi: int
    offset: int


def plan_chunks(page_bytes: Sequence[int], num_pages: int, max_chunk_bytes: int) -> list[list[Segment]]:
    """Cut the payload (pieces in order, each `num_pages` rows of `page_bytes[piece]`) into chunks of at most
    `max_chunk_bytes`, at page-row boundaries (a single row larger than the cap travels alone)."""
    chunks: list[list[Segment]] = []
    cur: list[Segment] = []
    used = 0
    for piece, row in enumerate(page_bytes):
        lo = 0
        while lo < num_pages:
            fit = (max_chunk_bytes - used) // row
            if fit <= 0 and cur:
                chunks.append(cur)
                cur, used = [], 0
                continue
            hi = min(num_pages, lo + max(fit, 1))
            cur.append(Segment(piece, lo, hi, used))
            used += (hi - lo) * row
            lo = hi
    if cur:
        chunks.append(cur)
    return chunks


def chunk_nbytes(chunk: list[Segment], page_bytes: Sequence[int]) -> int:
    last = chunk[-1]
    return last.offset + (last.page_hi - last.page_lo) * page_bytes[last.piece]


@functools.lru_cache(maxsize=256)
def _chunk_sizes(page_bytes: tuple[int, ...], num_pages: int, max_chunk_bytes: int) -> tuple[int, ...]:
    return tuple(chunk_nbytes(c, page_bytes) for c in plan_chunks(page_bytes, num_pages, max_chunk_bytes))


def header_chunk_sizes(header: KVHeader) -> tuple[int, ...]:
    """Bytes of each message of a payload, from its header alone (what the receiver posts before checking it)."""
    return _chunk_sizes(tuple(p[2] for p in header.pieces()), header.num_pages, header.max_chunk_bytes)


def _words_sum(buf: torch.Tensor) -> torch.Tensor:
    """A cheap checksum of a uint8 staging buffer: the sum of its 32-bit (or byte) words, as a 0-d int64 tensor
    on the buffer's device (no host sync: the sender ships its sums as one more message)."""
    words = buf.view(torch.int32) if buf.numel() % 4 == 0 else buf
    return words.sum(dtype=torch.int64)


# ---- bookkeeping shared by both ends ----------------------------------------------------------------------
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
        return _SendWorker if self.role == "sender" else _RecvWorker

    def add_peer(self, name: str, channel: PairChannel, route: Route) -> None:
        """Start the worker of one pair (it opens the channel in the background; see `wait_ready`)."""
        if name in self._workers:
            raise ValueError(f"name: peer {name!r} already added")
        self._check_route(route)
        self._check_channel(channel)
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
    def _check_channel(self, channel: PairChannel) -> None:
        if getattr(channel, "backend", "gloo") == "torch-nccl" and channel.timeout_s <= self.config.timeout_s:
            raise ValueError(f"channel: timeout_s {channel.timeout_s} must exceed the transfer timeout "
                             f"{self.config.timeout_s} (NCCL's watchdog would fire before this end gives up)")

    def _check_route(self, route: Route) -> None:
        lo, hi = self.kv_head_start, self.kv_head_start + self.num_local_heads
        if not lo <= route.head_start < route.head_end <= hi:
            raise ValueError(f"route: heads [{route.head_start}, {route.head_end}) are not within this shard's "
                             f"heads [{lo}, {hi})")

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


def _encode_status(ok: bool, reason: str | None, device: torch.device) -> torch.Tensor:
    """The receiver's answer as a fixed-size uint8 tensor: tag byte, reason length (2 bytes LE), reason."""
    text = (reason or "").encode()[:_STATUS_BYTES - 3]
    raw = bytes([_STATUS_OK if ok else _STATUS_REFUSED, len(text) & 0xFF, len(text) >> 8]) + text
    buf = torch.zeros(_STATUS_BYTES, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.to(device)


def _encode_statuses(answers: Sequence[tuple[bool, str | None]], device: torch.device) -> torch.Tensor:
    """One status per request of a payload, back to back (`_STATUS_BYTES` each)."""
    return torch.cat([_encode_status(ok, reason, torch.device("cpu")) for ok, reason in answers]).to(device)


def _decode_statuses(buf: torch.Tensor, n: int) -> list[tuple[bool, str]]:
    raw = buf.cpu().numpy().tobytes()
    out = []
    for i in range(n):
        one = raw[i * _STATUS_BYTES:(i + 1) * _STATUS_BYTES]
        if one[0] not in (_STATUS_OK, _STATUS_REFUSED):
            raise TransferError("internal", f"undecodable status from the receiver {one[:16]!r}")
        out.append((one[0] == _STATUS_OK, one[3:3 + one[1] + (one[2] << 8)].decode(errors="replace")))
    return out


def _encode_trailer(ops: Sequence[_Op]) -> bytes:
    """What follows an announced payload on the header stream: each request's meta (payload order) and which
    requests the sender withdrew (their bytes came, unused)."""
    return json.dumps({"trailer": [op.meta for op in ops],
                       "withdrawn": [i for i, op in enumerate(ops) if op.withdrawn]}).encode()


def _decode_trailer(raw: bytes, n: int) -> tuple[list[dict | None], set[int]]:
    """(meta per request, indices withdrawn) of an announced payload of `n` requests; ValueError if it is not
    a trailer of that many (the pair is then out of step)."""
    try:
        d = json.loads(raw)
        metas, withdrawn = d["trailer"], {int(i) for i in d["withdrawn"]}
    except Exception as exc:
        raise ValueError(f"undecodable KV trailer {raw[:120]!r}: {exc}") from exc
    if len(metas) != n or not withdrawn <= set(range(n)):
        raise ValueError(f"KV trailer for {len(metas)} requests, the header announced {n}")
    return metas, withdrawn


# ---- sender -------------------------------------------------------------------------------------------------
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


# ---- receiver -----------------------------------------------------------------------------------------------
class _RecvWorker(_PairWorker):
    """Blocks on the pair's header stream for the next header; then posts the chunk receives, one scatter launch per chunk
    (stream-ordered behind its receive on NCCL: no CPU wait until everything is queued), settles, and answers
    with the status over the backend."""

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


# ---- a fake wire that fails on purpose (stands in for a dead or faulty peer) ---------------------------------
class _DoneWork:
    def wait(self, *a) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class FaultyChannel:
    """Wraps a real `PairChannel` (used on the sending side) and breaks chosen requests, keyed by request id:

    (a payload of several requests breaks as a whole when any of them has a fault)
    "peer_gone":       the header cannot be delivered (PeerGone) - nothing reaches the receiver;
    "corrupt_header":  the header names a wrong dtype (same element size) - the receiver refuses and drains;
    "corrupt_payload": one byte of the first chunk flips on the wire - caught by the checksum;
    "drop_payload":    header delivered, payload never sent - the receiver times out mid-transfer (pair breaks).
    """

    inner: PairChannel
    faults: Mapping[str, str] = field(default_factory=dict)

    KINDS = ("peer_gone", "corrupt_header", "corrupt_payload", "drop_payload")

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.faults.items() if v not in self.KINDS}
        if bad:
            raise ValueError(f"faults: unknown kinds {bad}; known {self.KINDS}")
        self._flipped: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _fault(self, tag: str) -> str | None:
        """The fault of the first request in `tag` (a payload's request ids joined by "|") that has one: a
        batched payload breaks as a whole."""
        return next((self.faults[rid] for rid in tag.split("|") if rid in self.faults), None)

    def post_header(self, value: bytes, *, tag: str = "") -> None:
        fault = self._fault(tag)
        if fault == "peer_gone":
            raise PeerGone(f"injected for {tag!r}")
        d = json.loads(value) if fault == "corrupt_header" and value != _CLOSE else {}
        if "dtype" in d:  # a header (not an announced payload's trailer)
            # a wrong dtype of the same element size: the payload size stays what the sender sends
            d["dtype"] = {2: "torch.float16" if d["dtype"] != "torch.float16" else "torch.bfloat16",
                          4: "torch.int32"}.get(d["element_size"], "torch.uint8")
            value = json.dumps(d).encode()
        self.inner.post_header(value, tag=tag)

    def send(self, buf: torch.Tensor, *, tag: str = "") -> Any:
        fault = self._fault(tag)
        if fault == "drop_payload":
            return _DoneWork()
        if fault == "corrupt_payload" and tag not in self._flipped:
            self._flipped.add(tag)
            buf = buf.clone()
            buf[0] ^= 0x01
            work = self.inner.send(buf, tag=tag)
            self._keep = buf  # alive until the (asynchronous) send is done
            return work
        return self.inner.send(buf, tag=tag)


# ---- one shard's end, driven by plain values (what a ShardWorker forwards) ---------------------------------
class TransferAgent:
    """One shard's end of disaggregation: its pairs to the shards of remote groups and its per-request sends
    or receives. Every argument and result is a plain value, so a `ShardWorker` actor can host it and forward
    the calls unchanged (`workers.kv.group_agent.GroupTransferAgent` is the engine's side of that); the engine calls one
    agent per shard with the same page ids (a group's shards share page ids).

    role "prefill" holds a `KVSender`, "decode" a `KVReceiver`. Pairs are grouped by the remote group's name
    (the router's choice, e.g. "decode-0#2": replica decode-0, pair generation 2); each pair is a peer named
    "<group>/<remote tp rank>". The routes come from `plan_routes(num_kv_heads, prefill_tp, decode_tp)`: this
    shard takes the ones whose `dst` (decode) or `src` (prefill) is its tp rank. A prefill shard that has no
    route into a group (tp > KV heads: another replica of its heads sends them) has nothing to do for it:
    its sends there are recorded as DONE at once, with 0 bytes.

    A decode replica with attention DP has one receiving tp group per dp rank; what its `listen` returns is
    tagged with the dp rank (a "dp" key in each route dict), and `connect` then makes one sub-group per dp rank,
    named `dp_group(group, dp_rank)`: a request is sent to the sub-group of the dp rank that admitted it.
    `drop`, `broken` and `wait_ready` of `group` cover its sub-groups.
    """

    def __init__(self, kv: KVCache, *, role: str, num_kv_heads: int, tp: int = 1, tp_rank: int = 0,
                 config: TransferConfig = TransferConfig(), host: str = "127.0.0.1") -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: a transfer agent is 'prefill' or 'decode', got {role!r}")
        self.role, self.tp, self.tp_rank, self.num_kv_heads = role, tp, tp_rank, num_kv_heads
        self.config, self.host = config, host
        first, _count = kv_heads_of_rank(num_kv_heads, tp, tp_rank)
        cls = KVSender if role == "prefill" else KVReceiver
        self.end: KVSender | KVReceiver = cls(kv, kv_head_start=first, config=config)
        device = kv.k[0].device
        self.backend = ("nccl" if config.nccl == "direct" else "torch-nccl") if device.type == "cuda" else "gloo"
        self.device = device
        self.faults: dict[str, str] = {}  # transfer id -> FaultyChannel kind, on this side's channels (tests)
        self._groups: dict[str, list[str]] = {}
        self._dp_groups: dict[str, list[str]] = {}  # group -> its per-dp-rank sub-groups (connect)
        self._idle: dict[str, int] = {}  # transfer id -> page count: sends this shard had no route for

    @staticmethod
    def dp_group(group: str, dp_rank: int) -> str:
        """The name of dp rank `dp_rank`'s receivers within decode group `group`."""
        return f"{group}.dp{dp_rank}"

    def _channel_timeout(self) -> float:
        # must outlast one transfer (our own deadline acts first) and the pair's opening
        return max(2 * self.config.timeout_s, self.config.connect_timeout_s)

    # --- pairs ---
    def listen(self, group: str, remote_tp: int) -> list[tuple[dict, tuple[str, int]]]:
        """Decode side: host one pair per route from prefill group `group` (tp `remote_tp`) into this shard;
        returns [(route as a dict, address)] for the prefill shards to `connect`."""
        if self.role != "decode":
            raise ValueError("listen: only a decode shard listens")
        self.drop(group)
        out, names = [], []
        for r in plan_routes(self.num_kv_heads, remote_tp, self.tp):
            if r.dst != self.tp_rank:
                continue
            ch = PairChannel.listen(host=self.host, backend=self.backend, device=self.device,
                                    timeout_s=self._channel_timeout())
            name = f"{group}/{r.src}"
            self.end.add_peer(name, ch, r)
            names.append(name)
            out.append((dict(r.__dict__), ch.address))
        self._groups[group] = names
        return out

    def connect(self, group: str, listened: Sequence[tuple[dict, tuple[str, int]]]) -> None:
        """Prefill side: join the pairs that decode group `group`'s shards listen on, for this shard's routes.
        Entries tagged with a dp rank (a "dp" key) go to that dp rank's sub-group `dp_group(group, dp)`."""
        if self.role != "prefill":
            raise ValueError("connect: only a prefill shard connects")
        self.drop(group)
        by_group: dict[str, list[tuple[Route, tuple[str, int]]]] = {}
        for route_dict, address in listened:
            fields = dict(route_dict)
            dp = fields.pop("dp", None)
            by_group.setdefault(group if dp is None else self.dp_group(group, int(dp)), []).append(
                (Route(**fields), tuple(address)))
        for name_of_group, routes in by_group.items():
            names = []
            for r, address in routes:
                if r.src != self.tp_rank:
                    continue
                ch = PairChannel.connect(address, backend=self.backend, device=self.device,
                                         timeout_s=self._channel_timeout(), local_host=self.host)
                name = f"{name_of_group}/{r.dst}"
                self.end.add_peer(name, FaultyChannel(ch, self.faults), r)
                names.append(name)
            self._groups[name_of_group] = names
        subs = [g for g in by_group if g != group]
        if subs:
            self._dp_groups[group] = subs

    def _family(self, group: str) -> list[str]:
        """`group` and its dp sub-groups, those that exist."""
        return [g for g in (group, *self._dp_groups.get(group, ())) if g in self._groups]

    def wait_ready(self, timeout_s: float | None = None, group: str | None = None) -> None:
        """Block until the pairs (of `group` and its dp sub-groups, else all) are open."""
        peers = None if group is None else [n for g in self._family(group) for n in self._groups[g]]
        self.end.wait_ready(timeout_s, peers=peers)

    def drop(self, group: str) -> None:
        """Close every pair of `group` (and its dp sub-groups): replaced by a newer generation, or the remote
        replica is gone."""
        for g in self._family(group):
            for name in self._groups.pop(g, []):
                self.end.remove_peer(name)
        self._dp_groups.pop(group, None)

    @property
    def groups(self) -> list[str]:
        return list(self._groups)

    def broken(self, group: str) -> str | None:
        """Why a pair of `group` (or of its dp sub-groups) is broken (None if all are usable; 'unknown group'
        if there is none)."""
        family = self._family(group)
        if not family:
            return f"unknown group {group!r}"
        bad = self.end.broken_peers()
        return next((f"{n}: {bad[n]}" for g in family for n in self._groups[g] if n in bad), None)

    def set_faults(self, faults: Mapping[str, str]) -> None:
        """Inject faults by transfer id (FaultyChannel kinds) on this prefill shard's pairs; {} clears."""
        bad = {k: v for k, v in faults.items() if v not in FaultyChannel.KINDS}
        if bad:
            raise ValueError(f"faults: unknown kinds {bad}; known {FaultyChannel.KINDS}")
        self.faults.clear()
        self.faults.update(faults)

    # --- requests ---
    def _peers(self, group: str) -> list[str]:
        names = self._groups.get(group)
        if names is None:
            hint = f"; it is split by dp rank: {self._dp_groups[group]}" if group in self._dp_groups else ""
            raise ValueError(f"group: no pairs to {group!r} on this {self.role} shard (have "
                             f"{list(self._groups)}){hint}")
        return names

    def prepare(self, transfer_id: str, page_ids: Sequence[int], group: str) -> None:
        peers = self._peers(group)
        if not peers:
            raise ValueError(f"group: {group!r} has no pairs into this decode shard")
        self.end.prepare_receive(transfer_id, page_ids, peers=peers)

    def send_many(self, items: Sequence[tuple[str, Sequence[int], dict | None]], group: str,
                  withdrawn: Sequence[str] = ()) -> None:
        """Send requests' pages (transfer id, page ids, meta) to `group` as one payload per pair (the engine sends
        what one step handed off); `withdrawn`: requests announced to `group` that are not sent after all."""
        peers = self._peers(group)
        if not peers:  # another replica of this shard's heads sends them: nothing to move from here
            busy = [t for t, _ids, _m in items if t in self._idle or t in self.end._ops]
            if busy:
                raise ValueError(f"request_id: {busy[0]!r} already has a transfer on this prefill")
            for transfer_id, page_ids, _meta in items:
                self._idle[transfer_id] = len(page_ids)
            for transfer_id in withdrawn:
                self._idle[transfer_id] = 0
            return
        self.end.send_many(items, peers=peers, withdrawn=withdrawn)

    def announce(self, items: Sequence[tuple[str, Sequence[int]]], group: str) -> None:
        """Before the prefill step that writes their last pages: the headers of requests (transfer id, page
        ids) go to `group` now (`KVSender.announce`); `send_many` must follow for each, with or `withdrawn`."""
        peers = self._peers(group)
        if peers:  # else nothing moves from this shard (see send_many)
            self.end.announce(items, peers=peers)

    def _idle_result(self, transfer_id: str) -> TransferResult:
        return TransferResult(request_id=transfer_id, state=TransferState.DONE, settled=True,
                              num_pages=self._idle[transfer_id])

    def result(self, transfer_id: str) -> TransferResult:
        if transfer_id in self._idle:
            return self._idle_result(transfer_id)
        return self.end.result(transfer_id)

    def results(self, transfer_ids: Sequence[str]) -> list[TransferResult]:
        """`result` of each id (one call for all of a poll: a remote shard answers them in one round trip)."""
        return [self.result(t) for t in transfer_ids]

    def abort(self, transfer_id: str) -> bool:
        if transfer_id in self._idle:
            return True
        return self.end.abort(transfer_id)

    def release(self, transfer_id: str) -> TransferResult:
        if transfer_id in self._idle:
            res = self._idle_result(transfer_id)
            del self._idle[transfer_id]
            return res
        return self.end.release(transfer_id)

    def transfer_ids(self) -> list[str]:
        """Requests with bookkeeping on this shard (not released yet)."""
        with self.end._cond:
            return [*self.end._ops, *self._idle]

    def pop_stats(self) -> list[TransferStats]:
        return self.end.pop_stats()

    @staticmethod
    def combine(transfer_id: str, results: Sequence[TransferResult]) -> TransferResult:
        """One request over several shards: FAILED if any failed (reasons joined), DONE only if every shard is
        DONE, else TRANSFERRING (or PENDING if none started); settled when every shard is; bytes summed,
        seconds the longest shard's, each phase mark the latest shard's."""
        if len(results) == 1:
            return results[0]
        states = [r.state for r in results]
        failed = [r for r in results if r.state is TransferState.FAILED]
        if failed:
            state = TransferState.FAILED
        elif all(s is TransferState.DONE for s in states):
            state = TransferState.DONE
        elif all(s is TransferState.PENDING for s in states):
            state = TransferState.PENDING
        else:
            state = TransferState.TRANSFERRING
        return TransferResult(request_id=transfer_id, state=state, settled=all(r.settled for r in results),
                              reason="; ".join(r.reason for r in failed if r.reason) or None,
                              num_bytes=sum(r.num_bytes for r in results),
                              seconds=max(r.seconds for r in results),
                              num_pages=max(r.num_pages for r in results),
                              marks={k: max(r.marks[k] for r in results if k in r.marks)
                                     for k in {k for r in results for k in r.marks}},
                              meta=next((r.meta for r in results if r.meta is not None), None))

    def add_listener(self, fn) -> None:
        self.end.add_listener(fn)

    def close(self) -> None:
        for group in list(self._groups):
            self.drop(group)
        self.end.close()


__all__ = ["TransferConfig", "TransferState", "TransferResult", "Route", "plan_routes", "kv_heads_of_rank",
           "KVHeader", "Segment", "plan_chunks", "KVSender", "KVReceiver", "FaultyChannel", "TransferAgent"]
