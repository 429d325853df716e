"""A fake wire that fails on purpose (stands in for a dead or faulty peer): `FaultyChannel`."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.kv.config import _CLOSE
from workers.kv.transport import PairChannel, PeerGone


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
