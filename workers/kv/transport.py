"""The wire under the KV transfer: one 2-party channel per (prefill shard, decode shard) pair.

A `PairChannel` is three connections between the two sides: a TCPStore (rendezvous only), a header stream (a plain
TCP connection, TCP_NODELAY: one small length-prefixed message per transfer, sender -> receiver) and a standalone
2-rank backend built from the store (point-to-point send/recv: the payload, and the receiver's status back). On
GPU that is an NCCL communicator of its own (workers/kv/nccl.py: `ncclSend`/`ncclRecv` on the channel's stream,
after what the posting thread's stream queued; its id goes through the store), because ProcessGroupNCCL's host
cost per post (~0.14 ms on the H200 host) sat on the transfer's critical path on both sides; "torch-nccl" keeps
ProcessGroupNCCL. On CPU it is `ProcessGroupGloo(store, rank, 2, ...)`. The torch backends are constructed
directly instead of through `init_process_group`/`new_group`, because the default group is process-global: a
shard must be able to hold several pair channels next to its TP group.

Why the header does not go through the backend: the decode shard cannot know when a prefill will finish (queue +
compute: seconds to minutes), so a header receive posted on the backend would wait that long. On NCCL that is a
kernel spinning on the decode GPU during decode steps, killed (with the process, by default) by the watchdog
after the channel timeout; on gloo a timed-out receive closes the connection. So the receiver's pair thread
blocks in a socket read (no GIL, no device), and the payload and status are posted on the backend only once a
payload of known size is known to follow, with deadlines shorter than the backend's own timeout.
Why a socket and not the store (measured on 2 x H200, bench_kv_transfer.py): a store `set` is a round trip and
a waiting `get` another one after the key appears, ~0.1-0.2 ms on the transfer's critical path; the stream's
write returns at once and the reader wakes on arrival.

Rendezvous: the listening side (rank 0, by convention the decode shard) binds a socket on a port the OS picks,
on 127.0.0.1 unless told otherwise; the other side connects to `channel.address`. Both sides must then call
`open()` concurrently (it is a rendezvous: the gloo constructor blocks until both ranks joined).

`listen` and `connect` touch no TCPStore: `open()` (a pair worker's thread, in the background) builds them. The
listener hands its bound socket to the store (`master_listen_fd`); a peer that connects earlier waits in the
socket's backlog. Why: every TCPStore connection (the server's own one too) makes torch reverse-resolve the
peer's address (`getnameinfo` without NI_NUMERICHOST, for its log text), and for the IPv4-mapped loopback
address `/etc/hosts` does not answer, so it goes to DNS; a DNS server that drops a query costs the resolver's
5 s timeout (seen on the test box for about 1 connection in 17-25: `PairChannel.listen`, with its three
connections, then took 5 s in 1 of 10-20 calls; now it takes ~0 ms). In `open()` such a stall delays one pair's
opening, not the caller, and pairs open side by side. Rank 0 uses the server's own connection as its client, and
the header stream is a plain socket (no name lookup): two store connections per pair in all. The header port is
published in the store by rank 0 (key "hdr_port").
"""
from __future__ import annotations

import datetime
import select
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist


BACKENDS = ("gloo", "nccl", "torch-nccl")


class StreamWork:
    """The completion of an op posted on a CUDA stream (the nccl backend): an event recorded right after it."""

    __slots__ = ("event", "buf")

    def __init__(self, stream: torch.cuda.Stream, buf: torch.Tensor) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self.buf = buf

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> bool:
        """Order what the current stream runs next after the op (the CPU does not wait)."""
        torch.cuda.current_stream(self.buf.device).wait_event(self.event)
        return True


class TransferError(RuntimeError):
    """A transfer failed; `reason` is a short machine-readable word (timeout, peer_gone, mismatch, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class TransferTimeout(TransferError):
    def __init__(self, detail: str = "") -> None:
        super().__init__("timeout", detail)


class PeerGone(TransferError):
    def __init__(self, detail: str = "") -> None:
        super().__init__("peer_gone", detail)


_PEER_CHECK_S = 0.005  # how often an NCCL wait looks whether the peer's end of the header stream is gone


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def poll_until(done, deadline: float, what: str) -> None:
    """Wait for `done()` until the monotonic `deadline`: yield-spin for the first 2 ms (a CUDA copy or an
    NCCL message usually finishes within that, and time.sleep(20e-6) really sleeps ~60 us), then sleep 100 us."""
    spin_until = time.monotonic() + 2e-3
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise TransferTimeout(f"{what}: not completed in time")
        time.sleep(0 if now < spin_until else 100e-6)


def _classify(exc: BaseException, what: str) -> TransferError:
    """Map a backend/store exception onto timeout or peer_gone (the only two ways the wire fails)."""
    text = str(exc)
    if isinstance(exc, TransferError):
        return exc
    if "timeout" in text.lower() or "timed out" in text.lower():
        return TransferTimeout(f"{what}: {text.splitlines()[0][:300]}")
    return PeerGone(f"{what}: {text.splitlines()[0][:300]}")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")


def _bound_socket(host: str) -> socket.socket:
    """A listening TCP socket on a port of `host` that the OS picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerGone("header stream closed mid-header")
        got += k
    return bytes(buf)


class PairChannel:
    """One side of a 2-party channel. Rank 0 listens (hosts the store), rank 1 connects.

    backend: "gloo" (CPU tensors), "nccl" (CUDA tensors of `device`; our own calls into libnccl, workers/kv/nccl.py,
    ops on the channel's stream after the posting thread's current one) or "torch-nccl" (the same through torch's
    ProcessGroupNCCL, which costs ~0.14 ms of host time per post). Data-plane calls of one channel must be
    posted in one order on each side (the sender and receiver serialise them per pair), which keeps send/recv order
    identical on both sides; their works may be waited on from another thread. `tag` arguments name the request
    a message belongs to; the real channel ignores them (the fault-injecting fake in workers/kv/faults.py keys its
    faults on them).
    """

    def __init__(self, *, rank: int, host: str, port: int, backend: str, device: torch.device | str,
                 timeout_s: float, local_host: str, listen_socket: socket.socket | None = None) -> None:
        _check_backend(backend)
        self.rank = rank
        self.peer_rank = 1 - rank
        self.host, self.port = host, port
        self.backend = backend
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.local_host = local_host
        self._listen_socket = listen_socket  # rank 0, until open() hands it to the store
        self._hdr_listen: socket.socket | None = None  # rank 0: where the peer's header connection arrives
        self._hdr: socket.socket | None = None  # the header stream (rank 1 writes, rank 0 reads), made by open()
        self._hdr_lock = threading.Lock()
        self._next_peer_check = 0.0  # monotonic time of the next `peer_closed` look during an NCCL wait
        # the store (made by open()): rendezvous only. On rank 0 `_ctl` is the server store itself (the key space
        # lives there and it has its own client connection).
        self._ctl: Any = None
        self._pg: Any = None  # the torch backend (gloo, torch-nccl) or our NcclComm (nccl)
        self._wire: Any = None  # nccl: the CUDA stream the ops run on
        self._open_lock = threading.Lock()
        self.closed = False

    # ---- rendezvous ---------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, *, host: str = "127.0.0.1", backend: str = "gloo", device: torch.device | str = "cpu",
               timeout_s: float = 60.0) -> PairChannel:
        """Listen on a free port of `host` (chosen by the OS); the peer connects to `.address`. Returns at once:
        the pair's store is built on this socket by `open()`."""
        _check_backend(backend)  # before any socket is bound
        sock, hdr = _bound_socket(host), _bound_socket(host)
        ch = cls(rank=0, host=host, port=sock.getsockname()[1], backend=backend, device=device,
                 timeout_s=timeout_s, local_host=host, listen_socket=sock)
        ch._hdr_listen = hdr
        return ch

    @classmethod
    def connect(cls, address: tuple[str, int], *, backend: str = "gloo", device: torch.device | str = "cpu",
                timeout_s: float = 60.0, local_host: str = "127.0.0.1") -> PairChannel:
        """Join the pair whose listener published `address` = (host, port) (its store is reached by `open()`)."""
        host, port = address
        return cls(rank=1, host=host, port=int(port), backend=backend, device=device, timeout_s=timeout_s,
                   local_host=local_host)

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def _client(self) -> Any:
        try:
            return dist.TCPStore(self.host, self.port, None, False, timeout=_td(self.timeout_s))
        except Exception as exc:  # the listener is not there (any more)
            raise PeerGone(f"store at {self.host}:{self.port}: {exc}") from exc

    def _serve(self) -> Any:
        """Rank 0: the store server on the socket bound by `listen`; the store owns (and closes) it from here."""
        sock = self._listen_socket
        if sock is None:
            raise PeerGone("channel closed before it opened")
        try:
            server = dist.TCPStore(self.host, self.port, None, True, timeout=_td(self.timeout_s),
                                   wait_for_workers=False, master_listen_fd=sock.fileno())
        except Exception as exc:
            raise _classify(exc, f"store server on {self.host}:{self.port}") from exc
        sock.detach()
        self._listen_socket = None
        return server

    def _connect_store(self) -> None:
        """The store connection, once (the first `open()`)."""
        if self._ctl is None:
            self._ctl = self._serve() if self.rank == 0 else self._client()

    def _connect_headers(self) -> None:
        """The header stream, once: rank 0 publishes its header port in the store and accepts; rank 1 reads the
        port and connects. TCP_NODELAY: a header is one small write that must leave at once."""
        if self._hdr is not None:
            return
        try:
            if self.rank == 0:
                lst = self._hdr_listen
                self._ctl.set("hdr_port", str(lst.getsockname()[1]).encode())
                lst.settimeout(self.timeout_s)
                conn, _ = lst.accept()
                lst.close()
                self._hdr_listen = None
            else:
                self._ctl.set_timeout(_td(self.timeout_s))
                port = int(self._ctl.get("hdr_port"))
                conn = socket.create_connection((self.host, port), timeout=self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(None)
        except Exception as exc:
            raise _classify(exc, f"header connection on {self.host}") from exc
        self._hdr = conn

    def open(self) -> None:
        """Reach the store and the header stream, then build the 2-rank backend; blocks until the peer calls
        `open()` too (or the timeout passes)."""
        with self._open_lock:
            if self._pg is not None:
                return
            if self.closed:
                raise PeerGone("channel closed")
            self._connect_store()
            self._connect_headers()
            store = dist.PrefixStore("pg", self._ctl)
            try:
                if self.backend == "gloo":
                    opts = dist.ProcessGroupGloo._Options()
                    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.local_host)]
                    opts._timeout = _td(self.timeout_s)
                    self._pg = dist.ProcessGroupGloo(store, self.rank, 2, opts)
                elif self.backend == "nccl":
                    self._pg = self._direct_comm(store)
                    self._warm_up()
                else:
                    self._pg = dist.ProcessGroupNCCL(store, self.rank, 2, _td(self.timeout_s))
                    self._warm_up()
            except Exception as exc:
                raise _classify(exc, f"opening the {self.backend} pair") from exc

    def _direct_comm(self, store: Any) -> Any:
        """Rank 0 makes the communicator id and publishes it in the pair's store; both then join (blocks until
        both did; no deadline of ours inside NCCL's bootstrap, see docs/disaggregation.md, What remains)."""
        from workers.kv import nccl

        if self.rank == 0:
            store.set("nccl_uid", nccl.unique_id())
        else:
            store.set_timeout(_td(self.timeout_s))
        uid = store.get("nccl_uid")
        self._wire = torch.cuda.Stream(self.device)
        return nccl.NcclComm.init(bytes(uid), self.rank, 2, self.device)

    def _warm_up(self) -> None:
        """NCCL: one byte each way now. The communicator and each direction's connection are made lazily by the
        first send/recv, and that setup blocks the posting thread until the peer posts its side: a receive
        posted ahead of its payload (an announced one) or a status receive posted before the peer can send it
        would stall there. After this, posting never waits for the peer."""
        buf = torch.zeros(1, dtype=torch.uint8, device=self.device)
        deadline = time.monotonic() + self.timeout_s
        for sender in (1, 0):
            work = self.send(buf) if self.rank == sender else self.recv(buf)
            self.wait_work(work, deadline, "pair warm-up")
        torch.cuda.synchronize(self.device)

    # ---- control plane (the header stream) -----------------------------------------------------------------
    def post_header(self, raw: bytes, *, tag: str = "") -> None:
        """Rank 1: one header (length-prefixed) down the stream; returns once the kernel has it (no round trip)."""
        if len(raw) >= 2**32:
            raise ValueError("header: too large")
        try:
            with self._hdr_lock:
                self._hdr.sendall(len(raw).to_bytes(4, "little") + raw)
        except Exception as exc:
            raise _classify(exc, "header send") from exc

    def next_header(self, timeout_s: float, *, tag: str = "") -> bytes:
        """Rank 0: block until the next header arrives (at most `timeout_s` for its first byte: TransferTimeout)
        and return it. The rest of a started header is read under the channel timeout, so a timeout never
        leaves half a header behind. EOF (peer gone, or `wake`) is PeerGone."""
        sock = self._hdr
        if sock is None:
            raise PeerGone("header stream closed")
        try:
            sock.settimeout(timeout_s)
            try:
                first = sock.recv(4)
            except (socket.timeout, TimeoutError):
                raise TransferTimeout("no header in time") from None
            if not first:
                raise PeerGone("header stream closed by the peer")
            sock.settimeout(self.timeout_s)
            size = int.from_bytes(first + _recv_exact(sock, 4 - len(first)), "little")
            return _recv_exact(sock, size)
        except TransferError:
            raise
        except Exception as exc:
            raise _classify(exc, "header receive") from exc

    def wake(self) -> None:
        """From another thread: end a `next_header` wait (it raises PeerGone; the worker then sees its stop
        flag). Before `open()` made the stream there is nobody to wake: a worker checks its flag after open()."""
        sock = self._hdr
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ---- data plane (backend) -----------------------------------------------------------------------------
    def send(self, buf: torch.Tensor, *, tag: str = "") -> Any:
        """Post sending `buf` to the peer, after what the current stream queued; returns its work (`wait_work`)."""
        try:
            if self.backend == "nccl":
                return self._post_direct(self._pg.send, buf)
            return self._pg.send([buf], self.peer_rank, 0)
        except Exception as exc:
            raise _classify(exc, "send") from exc

    def recv(self, buf: torch.Tensor, *, tag: str = "") -> Any:
        """Post receiving into `buf` from the peer, after what the current stream queued; returns its work."""
        try:
            if self.backend == "nccl":
                return self._post_direct(self._pg.recv, buf)
            return self._pg.recv([buf], self.peer_rank, 0)
        except Exception as exc:
            raise _classify(exc, "recv") from exc

    def _post_direct(self, fn, buf: torch.Tensor) -> StreamWork:
        """The op on the channel's own stream, after what the current stream queued so far (the gather that
        filled `buf`), as ProcessGroupNCCL does: a payload's next gather or the previous chunk's scatter then
        overlaps this op's wire time. `buf` is recorded on that stream, so the allocator keeps its memory until
        the op ran even if the caller drops it first."""
        comm, wire = self._pg, self._wire
        if comm is None:
            raise PeerGone("channel aborted")
        wire.wait_stream(torch.cuda.current_stream(self.device))
        fn(buf, self.peer_rank, wire)
        buf.record_stream(wire)
        return StreamWork(wire, buf)

    def wait_work(self, work: Any, deadline: float, what: str, *, grace_s: float = 0.0) -> None:
        """Wait for one send/recv until the monotonic `deadline`.

        gloo: the CPU blocks in the work itself (gloo works only complete inside `wait`), for up to `grace_s`
        past the deadline: a gloo wait that times out closes the connection, so the side whose peer is expected
        to give up first (the sender, waiting for the receiver's status) lets the peer's own timeout act, and
        reports `timeout` when the peer's closing arrives after our deadline. NCCL: `wait()` only orders the
        current stream behind the communication, so poll completion instead (keeping the deadline) and then
        order the stream.
        """
        try:
            if self.backend == "gloo":
                work.wait(_td(deadline + grace_s - time.monotonic()))
                return
            # NCCL: an op whose peer died or aborted never completes; the header stream's end says so
            poll_until(lambda: work.is_completed() or self.check_peer(what), deadline, what)
            self.check_aborted(what)
            work.wait()
        except Exception as exc:
            err = _classify(exc, what)
            if time.monotonic() > deadline and not isinstance(err, TransferTimeout):
                err = TransferTimeout(f"{what}: not completed in time ({err})")
            raise err from exc

    def order_after(self, work: Any, deadline: float, what: str) -> None:
        """Make what the current thread queues next run after `work`. NCCL: stream ordering only, the CPU does
        not wait (so the scatter kernels are launched while the bytes are still in flight; the caller enforces
        the deadline on the stream afterwards). gloo: the CPU waits, as in `wait_work`."""
        if self.backend != "gloo":
            try:
                work.wait()
            except Exception as exc:
                raise _classify(exc, what) from exc
        else:
            self.wait_work(work, deadline, what)

    def abort(self) -> None:
        """Tear the data plane down (a pending NCCL kernel is killed) and shut the header stream, so the peer
        learns at once (its header read or its `wait_work` sees the stream end) instead of at its deadline; the
        channel is unusable afterwards."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()  # nccl: ncclCommAbort (pending kernels exit); torch backends: their abort
            except Exception:
                pass
        self.wake()

    def check_aborted(self, what: str) -> None:
        """Raise PeerGone if this side aborted the channel: an aborted NCCL op's kernel exits, so its completion
        event fires and the op would read as done with its bytes not (all) there."""
        if self._pg is None:
            raise PeerGone(f"{what}: the pair was aborted")

    def peer_closed(self) -> bool:
        """Whether the header stream has ended (the peer aborted, closed or died), without reading from it: a
        non-blocking peek (a header waiting to be read is not an end)."""
        sock = self._hdr
        if sock is None:
            return True
        try:
            poller = select.poll()  # not select(): a Ray worker's descriptors may be past FD_SETSIZE
            poller.register(sock, select.POLLIN)
            if not poller.poll(0):
                return False
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # closed under us
            return True

    def check_peer(self, what: str) -> bool:
        """For NCCL waits: raise PeerGone once the peer's end of the header stream is gone (checked every few
        ms: an NCCL operation whose peer died or aborted would otherwise wait for its whole deadline)."""
        now = time.monotonic()
        if now < self._next_peer_check:
            return False
        self._next_peer_check = now + _PEER_CHECK_S
        if self.peer_closed():
            raise PeerGone(f"{what}: the peer closed the pair")
        comm = self._pg
        if self.backend == "nccl" and comm is not None:
            err = comm.async_error()  # NCCL's own view: a lost connection, a remote error
            if err is not None:
                raise PeerGone(f"{what}: {err}")
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        pg, self._pg = self._pg, None
        if pg is not None and self.backend != "gloo":
            try:  # nccl: abort, never a graceful destroy (that waits for ops a gone peer never completes)
                pg.abort() if self.backend == "nccl" else pg.shutdown()
            except Exception:
                pass
        self._ctl = None
        for name in ("_listen_socket", "_hdr_listen", "_hdr"):  # the first only if never opened
            sock = getattr(self, name)
            setattr(self, name, None)
            if sock is not None:
                sock.close()


__all__ = ["BACKENDS", "PairChannel", "StreamWork", "TransferError", "TransferTimeout", "PeerGone", "poll_until"]
