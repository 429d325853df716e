"""The wire under the KV transfer: one 2-party channel per (prefill shard, decode shard) pair.

A `PairChannel` is a TCPStore (rendezvous, and one small keyed message per transfer: its header) plus a
standalone torch.distributed backend of two ranks built from that store (point-to-point send/recv: the payload,
and the receiver's status back; NCCL on GPU, gloo on CPU). The backend is constructed directly
(`ProcessGroupGloo(store, rank, 2, ...)`, `ProcessGroupNCCL(store, rank, 2, timeout)`) instead of through
`init_process_group`/`new_group`, because the default group is process-global: a shard must be able to hold
several pair channels next to its TP group.

Why the header still goes through the store and not through the backend: the decode shard cannot know when a
prefill will finish (queue + compute: seconds to minutes), so a header receive posted on the backend would wait
that long. On NCCL that is a kernel spinning on the decode GPU during decode steps, killed (with the process, by
default) by the watchdog after the channel timeout; on gloo a timed-out receive closes the connection. A "doorbell"
through the store before a backend header would cost the same one store message as the header itself, plus one
backend message. So: the header is the one store message of a transfer (one-way: the receiver is already blocked
in `get`), and everything after it (payload, status) is posted on the backend only once a payload of known size
is known to follow, with deadlines shorter than the backend's own timeout.

Rendezvous: the listening side (rank 0, by convention the decode shard) binds a socket on a port the OS picks,
on 127.0.0.1 unless told otherwise; the other side connects to `channel.address`. Both sides must then call
`open()` concurrently (it is a rendezvous: the gloo constructor blocks until both ranks joined).

`listen` and `connect` touch no TCPStore: `open()` (a pair worker's thread, in the background) builds them. The
listener hands its bound socket to the store (`master_listen_fd`); a peer that connects earlier waits in the
socket's backlog. Why: every TCPStore connection (the server's own one too) makes torch reverse-resolve the
peer's address (`getnameinfo` without NI_NUMERICHOST, for its log text), and for the IPv4-mapped loopback
address `/etc/hosts` does not answer, so it goes to DNS; a DNS server that drops a query costs the resolver's
5 s timeout (seen on the test box for about 1 connection in 17-25: `PairChannel.listen`, with its three
connections, then took 5 s in 1 of 10-20 calls; now it takes ~0 ms). In `open()` such a stall delays one pair's opening, not the caller, and pairs open side by side.
Rank 0 also uses the server's own connection as its control client, one connection fewer.
"""
from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist


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


class PairChannel:
    """One side of a 2-party channel. Rank 0 listens (hosts the store), rank 1 connects.

    backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors of `device`). Data-plane calls of one channel must be
    posted in one order on each side (workers/transfer.py serialises them per pair), which keeps send/recv order
    identical on both sides; their works may be waited on from another thread. `tag` arguments name the request
    a message belongs to; the real channel ignores them (the fault-injecting fake in workers/transfer.py keys its
    faults on them).
    """

    def __init__(self, *, rank: int, host: str, port: int, backend: str, device: torch.device | str,
                 timeout_s: float, local_host: str, listen_socket: socket.socket | None = None) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: must be 'gloo' or 'nccl', got {backend!r}")
        self.rank = rank
        self.peer_rank = 1 - rank
        self.host, self.port = host, port
        self.backend = backend
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.local_host = local_host
        self._listen_socket = listen_socket  # rank 0, until open() hands it to the store
        # two client connections (made by open()): a TCPStore client serialises its operations, so a thread
        # blocked in `get` on one would stall everybody else using the same object. On rank 0 `_ctl` is the
        # server store itself (the key space lives there and it has its own client connection).
        self._ctl: Any = None
        self._aux: Any = None
        self._get_timeout: float | None = None
        self._pg: Any = None
        self._open_lock = threading.Lock()
        self.closed = False

    # ---- rendezvous ---------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, *, host: str = "127.0.0.1", backend: str = "gloo", device: torch.device | str = "cpu",
               timeout_s: float = 60.0) -> PairChannel:
        """Listen on a free port of `host` (chosen by the OS); the peer connects to `.address`. Returns at once:
        the pair's store is built on this socket by `open()`."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return cls(rank=0, host=host, port=sock.getsockname()[1], backend=backend, device=device,
                   timeout_s=timeout_s, local_host=host, listen_socket=sock)

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
        """The control connections, once (the first `open()`)."""
        if self._ctl is None:
            self._ctl = self._serve() if self.rank == 0 else self._client()
        if self._aux is None:
            self._aux = self._client()

    def open(self) -> None:
        """Reach the store, then build the 2-rank backend; blocks until the peer calls `open()` too (or the
        timeout passes)."""
        with self._open_lock:
            if self._pg is not None:
                return
            if self.closed:
                raise PeerGone("channel closed")
            self._connect_store()
            store = dist.PrefixStore("pg", self._ctl)
            try:
                if self.backend == "gloo":
                    opts = dist.ProcessGroupGloo._Options()
                    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.local_host)]
                    opts._timeout = _td(self.timeout_s)
                    self._pg = dist.ProcessGroupGloo(store, self.rank, 2, opts)
                else:
                    # the NCCL communicator itself is created lazily on the first send/recv of this device
                    self._pg = dist.ProcessGroupNCCL(store, self.rank, 2, _td(self.timeout_s))
            except Exception as exc:
                raise _classify(exc, f"opening the {self.backend} pair") from exc

    @property
    def is_open(self) -> bool:
        return self._pg is not None

    # ---- control plane (store) ----------------------------------------------------------------------------
    def put(self, key: str, value: bytes, *, tag: str = "") -> None:
        try:
            self._ctl.set(key, value)
        except Exception as exc:
            raise _classify(exc, f"store set {key}") from exc

    def get(self, key: str, timeout_s: float, *, tag: str = "") -> bytes:
        """Block until `key` exists (at most `timeout_s`) and return it (one round trip: the store's `get`
        waits for the key itself)."""
        try:
            if timeout_s != self._get_timeout:
                self._ctl.set_timeout(_td(timeout_s))
                self._get_timeout = timeout_s
            return self._ctl.get(key)
        except Exception as exc:
            raise _classify(exc, f"store get {key}") from exc

    def delete(self, key: str) -> None:
        """Drop a consumed key (off the critical path: after the transfer it belonged to)."""
        try:
            self._ctl.delete_key(key)
        except Exception:
            pass

    def wake(self, key: str, value: bytes) -> None:
        """Set a key from another thread (used to wake a worker blocked in `get`). Before `open()` reached the
        store there is nobody to wake: a worker checks its stop flag once `open()` returned."""
        aux = self._aux
        if aux is None:
            return
        try:
            aux.set(key, value)
        except Exception:
            pass  # the store is gone: the worker will notice by itself

    # ---- data plane (backend) -----------------------------------------------------------------------------
    def send(self, buf: torch.Tensor, *, tag: str = "") -> Any:
        try:
            return self._pg.send([buf], self.peer_rank, 0)
        except Exception as exc:
            raise _classify(exc, "send") from exc

    def recv(self, buf: torch.Tensor, *, tag: str = "") -> Any:
        try:
            return self._pg.recv([buf], self.peer_rank, 0)
        except Exception as exc:
            raise _classify(exc, "recv") from exc

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
            poll_until(work.is_completed, deadline, what)
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
        if self.backend == "nccl":
            try:
                work.wait()
            except Exception as exc:
                raise _classify(exc, what) from exc
        else:
            self.wait_work(work, deadline, what)

    def abort(self) -> None:
        """Tear the data plane down (a pending NCCL kernel is killed); the channel is unusable afterwards."""
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:
                pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == "nccl":
            try:
                pg.shutdown()
            except Exception:
                pass
        self._ctl = self._aux = None
        sock, self._listen_socket = self._listen_socket, None
        if sock is not None:  # never opened: the socket is still ours
            sock.close()


__all__ = ["PairChannel", "TransferError", "TransferTimeout", "PeerGone", "poll_until"]
