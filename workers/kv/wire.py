"""The wire format (pure): the JSON header of a payload, the chunk plan of its pages, the receiver's status
messages and the announced payload's trailer."""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.kv.config import _STATUS_OK, _STATUS_REFUSED, _HEADER_VERSION, _STATUS_BYTES
from workers.kv.transport import TransferError

if TYPE_CHECKING:  # the codecs only read ops; endpoint.py imports this module
    from workers.kv.endpoint import _Op


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
