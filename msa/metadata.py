"""Per-step batch description for the paged forward: which tokens, at which positions, in which pages.

A step is a flat list of T new tokens from R requests. Prefill chunks come first, decode rows (one token each)
are the batch suffix, so kernels can route rows [0, num_prefill_tokens) and [num_prefill_tokens, T) apart.
"""
from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, kw_only=False)
class ChunkSpec:
    """One request's new tokens this step: positions start .. start + num_tokens - 1.

    page_table: the request's page ids (logical block b lives in page page_table[b]); must cover every position
    up to start + num_tokens - 1. start: tokens already in the cache. is_decode: a single-token decode row.
    all_logits: return logits for every token of the chunk (else only the last).
    """

    page_table: list[int]
    start: int
    num_tokens: int
    is_decode: bool
    all_logits: bool = False


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """Tensors of one step (T tokens, R requests).

    positions [T] int64: absolute position of each token in its request.
    slot_mapping [T] int64: page_id * page_size + offset where the token's K/V go (-1 = padding, not written).
    row_seq [T] int32: request index (0..R-1) of each token.
    page_tables [R, max_pages] int32: page ids per request (padded with 0 past the request's pages).
    query_start_loc [R+1] int32: token offsets of each request's chunk.
    context_lens [R] int32: tokens in the cache after this step (start + num_tokens).
    num_prefill_tokens: rows [0, num_prefill_tokens) are prefill-chunk tokens; the rest are decode rows.
    num_prefill_requests: requests [0, num_prefill_requests) own those rows (prefill chunks come first).
    max_prefill_len: the longest prefill chunk's token count (host int: the prefill kernels' grids).
    logits_indices [N] int64: rows whose logits are wanted (last token per chunk, all tokens with all_logits).
    moe_group_tokens: the token count the capacity MoE dispatch sizes its buffers from (host int, the same on
    every rank of an ep group; msa/moe.py). None: this step's own T, which is right whenever the ep group's
    ranks run steps of one size (tp / ep inside one dp rank, or dp ranks padded to one bucket); dp ranks in
    lockstep running eager steps of different sizes set the largest of them.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    row_seq: torch.Tensor
    page_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    num_prefill_tokens: int
    logits_indices: torch.Tensor
    page_size: int
    max_context_len: int
    num_prefill_requests: int = 0
    max_prefill_len: int = 0
    moe_group_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    @property
    def prefill(self) -> tuple[torch.Tensor, int, int]:
        """(query_start_loc, num_prefill_requests, max_prefill_len): the prompt-row layout the kernels take."""
        return self.query_start_loc, self.num_prefill_requests, self.max_prefill_len


@dataclass(frozen=True, kw_only=True)
class HostMetadata:
    """`AttentionMetadata`'s int arrays on the host (build_metadata's first half): int64 numpy arrays, the same
    meaning and shapes as the device tensors (page_tables flat, [R * max_pages] row-major).

    logits_indices: the token rows whose logits are wanted, on the host, so a caller can pick among them
    without reading the device tensor back (a synchronisation)."""

    positions: np.ndarray
    slot_mapping: np.ndarray
    row_seq: np.ndarray
    page_tables: np.ndarray
    max_pages: int
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    logits_indices: np.ndarray
    num_prefill_tokens: int
    num_prefill_requests: int
    max_prefill_len: int
    page_size: int

    def to_device(self, stager: "Stager", extra: Sequence[tuple[list[int], torch.dtype]] = ()
                  ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """(the metadata on the stager's device, the `extra` int lists as tensors there): one staged copy for
        all of them."""
        i64, i32 = torch.int64, torch.int32
        lists = [(self.positions, i64), (self.slot_mapping, i64), (self.logits_indices, i64), (self.row_seq, i32),
                 (self.page_tables, i32), (self.query_start_loc, i32), (self.context_lens, i32), *extra]
        pos, slots, logits, row_seq, tables, qsl, ctx_lens, *rest = stager.stage(lists)
        meta = AttentionMetadata(
            positions=pos, slot_mapping=slots, row_seq=row_seq,
            page_tables=tables.reshape(len(self.context_lens), self.max_pages), query_start_loc=qsl,
            context_lens=ctx_lens, num_prefill_tokens=self.num_prefill_tokens, logits_indices=logits,
            page_size=self.page_size, max_context_len=int(self.context_lens.max(initial=0)),
            num_prefill_requests=self.num_prefill_requests, max_prefill_len=self.max_prefill_len)
        return meta, rest


def build_metadata(chunks: list[ChunkSpec], page_size: int, device="cpu") -> AttentionMetadata:
    """Flatten the step's chunks into `AttentionMetadata` (built on the host, then moved to `device` once). A
    runner keeps one `Stager` and calls `host_metadata(...).to_device(stager)` instead."""
    return host_metadata(chunks, page_size).to_device(Stager(device))[0]


def host_metadata(chunks: list[ChunkSpec], page_size: int) -> HostMetadata:
    """The step's chunks flattened into host int arrays (validated). Whole-array numpy work, no per-token Python:
    an 8k-token step built its lists in ~1 ms and converted them in ~1.5 ms more while the GPU waited (H200 trace
    of an 8 x 1k-token step)."""
    seen_decode = False
    for r, c in enumerate(chunks):
        _check_chunk(r, c, page_size, seen_decode)
        seen_decode |= c.is_decode
    n_req = len(chunks)
    starts = np.fromiter((c.start for c in chunks), np.int64, n_req)
    counts = np.fromiter((c.num_tokens for c in chunks), np.int64, n_req)
    qsl = np.zeros(n_req + 1, np.int64)
    np.cumsum(counts, out=qsl[1:])
    row_seq = np.repeat(np.arange(n_req, dtype=np.int64), counts)
    positions = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(starts - qsl[:-1], counts)
    max_pages = max((len(c.page_table) for c in chunks), default=0)
    tables = np.zeros((n_req, max_pages), np.int64)  # padded with page 0 past each request's pages
    for r, c in enumerate(chunks):
        tables[r, :len(c.page_table)] = c.page_table
    slots = tables[row_seq, positions // page_size] * page_size + positions % page_size
    if any(c.all_logits for c in chunks):
        logits = np.concatenate([np.arange(qsl[r] if c.all_logits else qsl[r + 1] - 1, qsl[r + 1])
                                 for r, c in enumerate(chunks)]).astype(np.int64)
    else:
        logits = qsl[1:] - 1
    prefill_lens = [c.num_tokens for c in chunks if not c.is_decode]
    return HostMetadata(positions=positions, slot_mapping=slots, row_seq=row_seq, page_tables=tables.reshape(-1),
                        max_pages=max_pages, query_start_loc=qsl, context_lens=starts + counts, logits_indices=logits,
                        num_prefill_tokens=sum(prefill_lens), num_prefill_requests=len(prefill_lens),
                        max_prefill_len=max(prefill_lens, default=0), page_size=page_size)


def pack(lists: Sequence[tuple[Sequence, torch.dtype]]) -> tuple[bytes, list[tuple[int, int, torch.dtype]]]:
    """[(values, int64 | int32 | float32 | bool)] -> (one native-endian blob, (byte offset, byte length, dtype) per
    list). Values are a list or a numpy array. Each list starts at a 16-byte boundary: a view of any dtype at its
    offset is aligned, and Triton, which compiles a kernel variant per pointer argument's 16-byte divisibility, sees
    the same alignment at every step (at 8 bytes the views' alignment followed the step's list lengths, and each
    new combination compiled new variants mid-serving: benchmarks/probe_compiles.py)."""
    parts: list[bytes] = []
    spans: list[tuple[int, int, torch.dtype]] = []
    offset = 0
    for values, dtype in lists:
        code = _ARRAY_CODES[dtype]
        if isinstance(values, np.ndarray):
            raw = values.astype(np.dtype(code), copy=False).tobytes()
        else:
            raw = array.array(code, values).tobytes()
        pad = -len(raw) % 16
        spans.append((offset, len(raw), dtype))
        parts.append(raw + bytes(pad))
        offset += len(raw) + pad
    return b"".join(parts), spans


class Stager:
    """Host int lists -> tensors on one device, through one pinned buffer and one non-blocking copy a step.

    A copy from pageable memory waits for the stream to drain, so the ~9 small copies a step made one by one each
    held the host (and every later launch) until the GPU caught up. The pinned buffer is kept and grown, never
    allocated per step: a fresh pinned block cost 4.3 ms of host time per 8k-token step on the H200 (measured,
    torch's caching host allocator). Before it is rewritten the previous step's copy is waited for (an event;
    done long before in practice, since the runner synchronises at the end of each step). On the CPU the lists
    simply become tensors."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None  # pinned uint8
        self._copied: torch.cuda.Event | None = None

    def stage(self, lists: Sequence[tuple[list[int], torch.dtype]]) -> list[torch.Tensor]:
        """[(values, dtype)] -> one tensor per list on the device, in order (laid out by `pack`)."""
        if self.device.type == "cpu":
            return [host_tensor(values, dtype) for values, dtype in lists]
        blob, spans = pack(lists)
        host = self._buffer(max(len(blob), 8))
        memoryview(host.numpy())[:len(blob)] = blob
        dev = host[:max(len(blob), 8)].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return [dev[o:o + n].view(dtype) for o, n, dtype in spans]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy still reads the buffer
        if self._host is None or self._host.numel() < nbytes:
            self._host = torch.empty(max(nbytes, 2 * (0 if self._host is None else self._host.numel()), 1 << 16),
                                     dtype=torch.uint8, pin_memory=True)
        return self._host


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.bool: "B"}


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list (or numpy array) through array.array: ~4x faster than torch.tensor(list) (~0.14 us
    an element), which an 8k-token step paid for several lists while the GPU waited."""
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values.astype(np.dtype(_ARRAY_CODES[dtype]), copy=False)).view(dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


def _check_chunk(r: int, c: ChunkSpec, page_size: int, seen_decode: bool) -> None:
    if c.num_tokens < 1 or c.start < 0:
        raise ValueError(f"chunks[{r}]: num_tokens must be >= 1 and start >= 0, got {c.num_tokens}, {c.start}")
    if c.is_decode and c.num_tokens != 1:
        raise ValueError(f"chunks[{r}]: a decode chunk holds exactly one token, got {c.num_tokens}")
    if seen_decode and not c.is_decode:
        raise ValueError(f"chunks[{r}]: prefill chunks must come before every decode chunk")
    need = -(-(c.start + c.num_tokens) // page_size)
    if len(c.page_table) < need:
        raise ValueError(f"chunks[{r}]: page_table has {len(c.page_table)} pages, {need} needed for "
                         f"{c.start + c.num_tokens} tokens")


__all__ = ["ChunkSpec", "AttentionMetadata", "HostMetadata", "Stager", "build_metadata", "host_metadata", "host_tensor",
           "pack"]
