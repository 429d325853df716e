"""What a transfer is configured with (`TransferConfig`), its states, and the wire's constants.

`TransferConfig` is the one transfer config of the project: the serve config's `transfer:` section is this class
(deploy/config.py), the engines get it as it is, and the router reads its own two knobs from it."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal


_CLOSE = b"__close__"
# 2: `meta` (the first token) and `batch` (several requests per payload, one status each) joined the header;
# 3: `announced` (the header goes ahead of the pages; each request's meta follows them in a trailer)
_HEADER_VERSION = 3
_STATUS_BYTES = 512  # the receiver's answer: one small message on the backend (reason text included)
_STATUS_OK, _STATUS_REFUSED = 0x4F, 0x52
_LAYOUTS_KEPT = 32  # chunk/copy plans kept per pair (one per page count seen recently)


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """Knobs of KV transfer between prefill and decode (timeouts in seconds): the transfer engine's, the engines'
    (`lease_s`, `announce`) and the router's (`retry_prefill`, `admit_wait_s`)."""

    timeout_s: float = 30.0  # one transfer, from its header to its status
    # how long a prepared receive waits for its header (prefill queue + compute); None: max(lease_s, timeout_s),
    # as the lease bounds that wait too
    receive_timeout_s: float | None = None
    connect_timeout_s: float | None = None  # building a pair (both sides must join); None: max(30, timeout_s)
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
    # the GPU data plane: "direct" (our own ncclSend/ncclRecv calls, workers/kv/nccl.py) or "torch"
    # (ProcessGroupNCCL, ~0.14 ms of host time per post on each side; docs/benchmarks.md, KV transfer, session 5)
    nccl: Literal["direct", "torch"] = "direct"
    # the router's side (deploy/pd.py; the engines never read these): a failed transfer runs the prefill once
    # more (on the first-token path) instead of answering 503 `kv_transfer_failed`
    retry_prefill: bool = False
    # when no decode replica has room for a prompt's KV pages, the router retries for up to this long before it
    # answers 503 `kv_capacity` (a burst of long prompts waits for running requests to finish); 0: at once
    admit_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.receive_timeout_s is None:
            object.__setattr__(self, "receive_timeout_s", max(self.lease_s, self.timeout_s))
        if self.connect_timeout_s is None:
            object.__setattr__(self, "connect_timeout_s", max(30.0, self.timeout_s))
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
        if self.admit_wait_s < 0:
            raise ValueError(f"admit_wait_s: must be >= 0, got {self.admit_wait_s}")


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)
