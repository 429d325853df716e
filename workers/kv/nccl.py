"""A minimal binding to libnccl (ctypes): one 2-rank communicator, send/recv on a given stream, abort.

Why not torch's ProcessGroupNCCL for the KV transfer's data plane (docs/benchmarks.md, KV transfer, session 5):
on the 2 x H200 host a one-off probe timed one `ProcessGroupNCCL.send` or `.recv` post at 136-140 us of host
time, and a transfer has one post on each side on its critical path (an 8k-token prompt's wire time is ~0.45 ms).
In bench_kv_transfer.py's timelines, gather launched -> send posted took 0.11 ms through ProcessGroupNCCL and 0.06
ms through this binding (header decoded -> receive posted: 0.14 and 0.11 ms), and the 8k transfer went from 54-58%
to 61-77% of the NCCL ceiling. The library is the one torch already loaded (same NCCL, same version); only the
calls are ours.

What the caller gets: `NcclComm.send(buf, stream)` / `recv(buf, stream)` enqueue on `stream` (no internal stream,
no cross-stream events: the caller's copy kernels on the same stream are ordered with it for free), and the caller
records an event after the op to learn its completion. NCCL has no timeouts: the caller polls with its own
deadline and `abort()`s (any thread) to kill a pending op, as the NCCL docs prescribe.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

import torch

_UNIQUE_ID_BYTES = 128
_NCCL_UINT8 = 1  # ncclDataType_t
_SUCCESS, _IN_PROGRESS = 0, 7  # ncclResult_t


class NcclError(RuntimeError):
    pass


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _UNIQUE_ID_BYTES)]


def _library_path() -> str:
    """The libnccl torch loaded into this process (so both share one NCCL), else the pip package's, else the
    loader's default."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnccl.so" in os.path.basename(path) and os.path.exists(path):
                    return path
    except OSError:
        pass
    try:
        import nvidia.nccl  # the wheel torch depends on (nvidia-nccl-cuXX)

        for d in nvidia.nccl.__path__:
            found = sorted(glob.glob(os.path.join(d, "lib", "libnccl.so*")))
            if found:
                return found[0]
    except ImportError:
        pass
    return "libnccl.so.2"


_LIB: ctypes.CDLL | None = None
_LIB_LOCK = threading.Lock()


def _lib() -> ctypes.CDLL:
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            lib = ctypes.CDLL(_library_path())
            vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
            for name, args in {
                "ncclGetUniqueId": [ctypes.POINTER(_UniqueId)],
                "ncclCommInitRank": [ctypes.POINTER(vp), i, _UniqueId, i],
                "ncclSend": [vp, sz, i, i, vp, vp],
                "ncclRecv": [vp, sz, i, i, vp, vp],
                "ncclCommAbort": [vp],
                "ncclCommGetAsyncError": [vp, ctypes.POINTER(i)],
            }.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, i
            lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
            _LIB = lib
        return _LIB


def _check(result: int, what: str) -> None:
    if result not in (_SUCCESS, _IN_PROGRESS):
        raise NcclError(f"{what}: NCCL error {result} ({_lib().ncclGetErrorString(result).decode()})")


def unique_id() -> bytes:
    """A fresh communicator id (rank 0 makes it; the peer gets it out of band, here through the pair's store)."""
    uid = _UniqueId()
    _check(_lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


class NcclComm:
    """One NCCL communicator of `nranks` ranks on `device`; this process is `rank`. Built by `init` (blocks until
    every rank joined). send/recv from any thread; `abort` ends pending ops and frees the communicator."""

    def __init__(self, handle: int, device: torch.device) -> None:
        self._handle = ctypes.c_void_p(handle)
        self.device = device
        self._lock = threading.Lock()  # abort vs. an error query from another thread

    @classmethod
    def init(cls, uid: bytes, rank: int, nranks: int, device: torch.device) -> NcclComm:
        if len(uid) != _UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id: {_UNIQUE_ID_BYTES} bytes expected, got {len(uid)}")
        u = _UniqueId()
        ctypes.memmove(u.internal, uid, _UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):  # NCCL binds the communicator to the current device
            _check(_lib().ncclCommInitRank(ctypes.byref(comm), nranks, u, rank), "ncclCommInitRank")
        return cls(comm.value, device)

    def _post(self, fn, buf: torch.Tensor, peer: int, stream: torch.cuda.Stream, what: str) -> None:
        if buf.device != self.device or not buf.is_contiguous():
            raise ValueError(f"{what}: a contiguous tensor on {self.device} expected, got {buf.device}")
        handle = self._handle  # not held under the lock: a first post to a peer blocks until the peer posts
        if handle.value is None:  # too (connection setup), and `abort` from another thread must end that wait
            raise NcclError(f"{what}: communicator aborted")
        _check(fn(ctypes.c_void_p(buf.data_ptr()), buf.numel() * buf.element_size(), _NCCL_UINT8, peer, handle,
                  ctypes.c_void_p(stream.cuda_stream)), what)

    def send(self, buf: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> None:
        """Enqueue sending `buf`'s bytes to `peer` on `stream` (returns at once)."""
        self._post(_lib().ncclSend, buf, peer, stream, "ncclSend")

    def recv(self, buf: torch.Tensor, peer: int, stream: torch.cuda.Stream) -> None:
        """Enqueue receiving `buf`'s bytes from `peer` on `stream` (returns at once)."""
        self._post(_lib().ncclRecv, buf, peer, stream, "ncclRecv")

    def async_error(self) -> str | None:
        """What went wrong in the background (a remote error, a lost connection), or None."""
        with self._lock:
            if self._handle.value is None:
                return "communicator aborted"
            res = ctypes.c_int()
            _check(_lib().ncclCommGetAsyncError(self._handle, ctypes.byref(res)), "ncclCommGetAsyncError")
        if res.value in (_SUCCESS, _IN_PROGRESS):
            return None
        return f"NCCL error {res.value} ({_lib().ncclGetErrorString(res.value).decode()})"

    def abort(self) -> None:
        """End every pending op of the communicator (their kernels exit) and free it; idempotent."""
        with self._lock:
            handle, self._handle = self._handle, ctypes.c_void_p()
        if handle.value is not None:
            _lib().ncclCommAbort(handle)


__all__ = ["NcclComm", "NcclError", "unique_id"]
