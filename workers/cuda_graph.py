"""CUDA-graph replay of pure-decode steps (what vLLM and nano-vllm do).

Why: an eager decode step launches hundreds of small kernels (per layer: norms, projections, RoPE, the K/V write,
index scores + top-k, attention, the MoE chain), and the host cannot launch them as fast as the GPU runs them.
On the H200 the m3-slice decode step at B=16 runs in ~5 ms as one graph but ~13 ms eagerly. A decode step has
one token per request, so its shapes depend on the batch size only: one graph per padded batch size ("bucket")
covers every decode step; prefill and mixed steps stay eager.

What is captured: the model forward + `compute_logits` over a decode batch of `bucket` rows, reading static
input buffers (`StaticInputs`) and writing a static logits buffer. Sampling stays outside (it changes per
request and syncs the host anyway). Per step the host packs the rows into a pinned staging buffer
(`fill_decode_inputs`, pure), one H2D copy moves it and three device copies scatter it into the static buffers
(`load_decode_inputs`), then the bucket's graph replays.

Fixed at capture, so chosen for the worst case:
  * the page-table width: ceil(max_model_len / page_size) columns. The kernels size their grids from it
    (kernels/index_topk.py splits the block axis over it, kernels/attention.py caps its splits with it) and loop
    at run time only up to each row's own block (`position // page_size`), leaving the other splits empty; they
    never read a table entry past a row's own block, so columns past the widest row of a step may hold stale ids.
  * `max_context_len` = max_model_len (a Python int of the metadata; no kernel reads it today).
  * every row is its own request (row_seq = arange, query_start_loc = arange, logits_indices = arange).
Padded rows (bucket - B of them): token 0 at position 0 with slot -1 (write_kv skips it: nothing is written),
context length 1 and page 0 (a page of the pool, so attention reads one token in bounds, never an empty row);
their logits are computed and never read. Every kernel computes rows independently (attention per row, GEMMs
and the fused MoE per token row), so what a padded row computes never reaches a real row.

Numerics: the graph replays the kernels an eager forward of the same padded batch launches, so its logits match
that forward's (bitwise, unless cuBLAS picks another algorithm under capture). Against an eager step of the
unpadded batch (B rows, a table as wide as the longest row) they agree to rounding, not bitwise: split counts,
GEMM tiles and the fused-MoE config are chosen from B and the table width (tests/workers/test_cuda_graph_gpu.py
measures both differences).

Capture happens at startup (`DecodeGraphs.capture`, called by the ModelRunner after the KV pool exists), largest
bucket first so the smaller graphs reuse its memory from the one shared pool. Why not lazily on first use: a
capture costs a warm-up forward (Triton compiles) plus the capture itself, which would land as a latency spike in
the middle of serving, and the pool's memory would be taken at an unpredictable time after the KV pool was sized
from free memory; at startup both are paid once, timed and logged, and a capture failure stops the engine
before it takes traffic.

Eligibility (`graph_skip_reason`, `is_graph_step`): a CUDA device, `enforce_eager` off, no host sync in the
forward (ep > 1 only with the capacity MoE dispatch: the exact-split all-to-all reads its split sizes on the
host; tp > 1 captures NCCL all-reduces, not validated on 2 GPUs yet: only with `cuda_graph_tp`), and a step
made only of single-token decode rows that all sample, no more than the largest bucket.

Attention-DP (dp ranks in lockstep over one ep group): the ep group's all-to-alls need every rank to run the
same shapes, so every dp rank runs the same bucket or none does (`plan_dp_step`: the group's largest step
picks it; a rank with fewer rows, or none, pads up to it: `prepare(..., bucket=)`). Padded rows never reach a
real row (see above), so each rank's tokens equal its unpadded run's.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from msa.metadata import AttentionMetadata, ChunkSpec
from workers.batch import StepBatch
from workers.config import EngineConfig

# The default buckets stop here: past it a decode step is bandwidth-bound for long, so the launch overhead a
# graph removes matters less than the memory and startup time of more graphs. Larger sizes can be listed.
DEFAULT_MAX_CAPTURE = 512
# Default buckets after 1, 2, 4, 8: (up to, step). A step pads fewer rows than the step size; each padded row
# costs little in a memory-bound decode step, each extra bucket costs startup time (one capture).
_DEFAULT_STEPS = ((32, 8), (128, 16), (256, 32), (DEFAULT_MAX_CAPTURE, 64))


def default_batch_sizes(max_num_seqs: int, cap: int = DEFAULT_MAX_CAPTURE) -> tuple[int, ...]:
    """Buckets 1, 2, 4, 8, then every 8 up to 32, every 16 up to 128, every 32 up to 256, every 64 up to 512,
    cut at min(max_num_seqs, cap), which is always the last bucket (no decode step holds more rows)."""
    top = min(max_num_seqs, cap)
    sizes = [1, 2, 4, 8]
    lo = 8
    for hi, step in _DEFAULT_STEPS:
        sizes.extend(range(lo + step, hi + 1, step))
        lo = hi
    return tuple(s for s in sizes if s < top) + (top,)


def capture_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The buckets an engine captures: `cuda_graph_batch_sizes`, else the defaults for its max_num_seqs."""
    return config.cuda_graph_batch_sizes or default_batch_sizes(config.max_num_seqs)


def pick_bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest bucket of ascending `sizes` holding n >= 1 rows; None when n exceeds the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graph_skip_reason(config: EngineConfig, device: torch.device, *, tp_size: int, ep_size: int,
                      moe_dispatch: str = "alltoall") -> str | None:
    """Why this shard runs every step eagerly, or None when it captures decode graphs."""
    if config.enforce_eager:
        return "enforce_eager is set"
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if ep_size > 1 and moe_dispatch != "capacity":
        return (f"ep > 1: the {moe_dispatch!r} MoE dispatch reads its split sizes on the host (a sync a graph "
                f"cannot hold); moe_dispatch 'capacity' does not")
    if tp_size > 1 and not config.cuda_graph_tp:
        return "tp > 1: NCCL all-reduce under graph capture is not validated on 2 GPUs yet (cuda_graph_tp)"
    return None


def plan_dp_step(per_rank: Sequence[tuple[int, int | None]], sizes: Sequence[int] | None
                 ) -> tuple[int, int | None]:
    """One lockstep step of the dp ranks of an ep group -> (the token count the capacity MoE dispatch sizes its
    buffers from, the bucket every rank replays or None for an eager step on every rank).

    per_rank: each dp rank's (tokens this step, decode rows if its step can replay a graph else None); an idle
    rank is (0, 0). sizes: the captured buckets (None: no graphs). Pure: every rank computes the same plan from
    the same exchanged counts. A graph step needs every rank's step to be a graph step (or idle) and the
    largest to fit a bucket; the buffers are then sized from the bucket (what the graph was captured with)."""
    tokens = max((t for t, _ in per_rank), default=0)
    rows = [r for _, r in per_rank]
    if sizes is None or any(r is None for r in rows) or max(rows, default=0) == 0:
        return tokens, None
    bucket = pick_bucket(sizes, max(rows))
    return (tokens, None) if bucket is None else (bucket, bucket)


def is_graph_step(batch: StepBatch, max_batch: int) -> bool:
    """A step the graphs can run: 1..max_batch single-token decode rows, each sampled (logits of exactly the
    rows), no prompt logprobs."""
    chunks = batch.chunks
    if not 0 < len(chunks) <= max_batch or batch.prompt_logprob_chunks:
        return False
    # sample_chunks are ascending distinct chunk indices: as many as chunks means every row samples, in order
    if len(batch.sample_chunks) != len(chunks):
        return False
    return all(c.is_decode and c.num_tokens == 1 and not c.all_logits for c in chunks)


# ---- static inputs ----------------------------------------------------------------------------------------------

def packed_len(bucket: int, width: int) -> int:
    """int64 words of one packed step: 4 per row (id, position, slot, context length) + a [bucket, width] table."""
    return bucket * (4 + width)


def fill_decode_inputs(buf: torch.Tensor, chunks: Sequence[ChunkSpec], input_ids: Sequence[int], bucket: int,
                       page_size: int, max_pages: int) -> int:
    """Pack one decode step, padded to `bucket` rows, into the front of `buf` (int64, CPU, contiguous, at least
    `packed_len(bucket, max_pages)` words) and return the table width W used (the longest page table).

    Layout (each a run of int64): ids [bucket] | positions [bucket] | slots [bucket] | context lens [bucket] |
    page tables [bucket, W] row-major. Row r < B: chunks[r]'s token input_ids[r] at position start, its slot
    page_table[start // page_size] * page_size + start % page_size, context length start + 1, its page ids then
    zeros. Padded rows: id 0, position 0, slot -1 (not written), context length 1, a table of zeros (page 0).
    B may be 0 (every row padding: an idle dp rank joining its group's bucket).
    """
    n = len(chunks)
    if not 0 <= n <= bucket or bucket < 1 or len(input_ids) != n:
        raise ValueError(f"fill_decode_inputs: {n} rows and {len(input_ids)} ids for a bucket of {bucket}")
    # at least one column, so padded rows' page 0 is written even in an all-padding step (a lockstep dp rank
    # with no rows)
    width = max((len(c.page_table) for c in chunks), default=1)
    if width > max_pages:
        raise ValueError(f"fill_decode_inputs: a page table of {width} pages exceeds the captured width "
                         f"{max_pages} (max_model_len)")
    a = buf.numpy()
    b = bucket
    starts = np.fromiter((c.start for c in chunks), np.int64, n)
    pages = np.fromiter((c.page_table[c.start // page_size] for c in chunks), np.int64, n)
    a[0:n] = input_ids
    a[b:b + n] = starts
    a[2 * b:2 * b + n] = pages * page_size + starts % page_size
    a[3 * b:3 * b + n] = starts + 1
    for run, pad in ((0, 0), (1, 0), (2, -1), (3, 1)):
        a[run * b + n:(run + 1) * b] = pad
    tables = a[4 * b:4 * b + b * width].reshape(b, width)
    tables[:] = 0
    for r, c in enumerate(chunks):
        tables[r, :len(c.page_table)] = c.page_table
    return width


@dataclass(frozen=True, kw_only=True)
class StaticInputs:
    """The device buffers every decode graph reads; a bucket's graph reads the first `bucket` rows.

    tokens [3, Bmax] int64: input ids, positions, slot mapping (one buffer: one device copy fills all three).
    context_lens [Bmax] int32. page_tables [Bmax, P] int32, P = pages of max_model_len.
    row_seq [Bmax] int32, query_start_loc [Bmax + 1] int32, logits_indices [Bmax] int64: aranges, never
    rewritten (every row is its own one-token request).
    """

    tokens: torch.Tensor
    context_lens: torch.Tensor
    page_tables: torch.Tensor
    row_seq: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, device) -> StaticInputs:
        """Buffers holding max_batch padded rows (see `fill_decode_inputs` for the padding values)."""
        tokens = torch.zeros((3, max_batch), dtype=torch.int64, device=device)
        tokens[2].fill_(-1)
        return cls(tokens=tokens,
                   context_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
                   page_tables=torch.zeros((max_batch, max_pages), dtype=torch.int32, device=device),
                   row_seq=torch.arange(max_batch, dtype=torch.int32, device=device),
                   query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
                   logits_indices=torch.arange(max_batch, dtype=torch.int64, device=device))

    @property
    def max_batch(self) -> int:
        return int(self.tokens.shape[1])

    def input_ids(self, bucket: int) -> torch.Tensor:
        return self.tokens[0, :bucket]

    def metadata(self, bucket: int, page_size: int, max_context_len: int) -> AttentionMetadata:
        """The first `bucket` rows as `AttentionMetadata` (views: a graph captured with it reads later fills)."""
        b = bucket
        return AttentionMetadata(positions=self.tokens[1, :b], slot_mapping=self.tokens[2, :b],
                                 row_seq=self.row_seq[:b], page_tables=self.page_tables[:b],
                                 query_start_loc=self.query_start_loc[:b + 1], context_lens=self.context_lens[:b],
                                 num_prefill_tokens=0, logits_indices=self.logits_indices[:b], page_size=page_size,
                                 max_context_len=max_context_len)


def load_decode_inputs(static: StaticInputs, packed: torch.Tensor, bucket: int, width: int) -> None:
    """Scatter a packed step (already on the static buffers' device) into the first `bucket` rows: three copies.
    Table columns >= width keep what they held (never read: see the module docstring)."""
    b = bucket
    static.tokens[:, :b].copy_(packed[:3 * b].view(3, b))
    static.context_lens[:b].copy_(packed[3 * b:4 * b])
    static.page_tables[:b, :width].copy_(packed[4 * b:4 * b + b * width].view(b, width))


# ---- the graphs -------------------------------------------------------------------------------------------------

class DecodeGraphs:
    """Decode-step graphs of one shard, one per bucket, over its model and KV pool.

    `run(chunks, input_ids)` -> logits [B, vocab] fp32 of the step's rows (a view of the static logits buffer,
    valid until the next run). `prepare` + `forward` run the same padded step eagerly (tests, CPU)."""

    def __init__(self, model, kv, *, sizes: Sequence[int], max_model_len: int, device) -> None:
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.sizes = tuple(sorted(sizes))
        self.page_size = kv.page_size
        self.max_pages = -(-max_model_len // kv.page_size)
        self.max_model_len = max_model_len
        max_batch = self.sizes[-1]
        self.static = StaticInputs.allocate(max_batch, self.max_pages, self.device)
        pin = self.device.type == "cuda"
        self.staging = torch.empty(packed_len(max_batch, self.max_pages), dtype=torch.int64, pin_memory=pin)
        self.logits = torch.zeros((max_batch, model.config.vocab_size), dtype=torch.float32, device=self.device)
        self._metas = {b: self.static.metadata(b, self.page_size, max_model_len) for b in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._copied: torch.cuda.Event | None = None  # the last H2D copy out of `staging`
        self.capture_seconds: float | None = None
        self.pool_bytes: int | None = None  # device memory reserved during capture (the graph pool, mostly)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def bucket(self, n: int) -> int | None:
        return pick_bucket(self.sizes, n)

    def prepare(self, chunks: Sequence[ChunkSpec], input_ids: Sequence[int], bucket: int | None = None) -> int:
        """Fill the static buffers with a decode step padded to its bucket (or to `bucket`, one of `sizes`
        holding the rows: a lockstep dp group's, `plan_dp_step`); returns the bucket."""
        b = self.bucket(len(chunks)) if bucket is None else bucket
        if b is None:
            raise ValueError(f"DecodeGraphs: {len(chunks)} rows exceed the largest bucket {self.max_batch}")
        if b not in self.sizes or b < len(chunks):
            raise ValueError(f"DecodeGraphs: bucket {b} is not a captured size holding {len(chunks)} rows "
                             f"(sizes {list(self.sizes)})")
        if self._copied is not None:
            # the previous step's copy out of the pinned staging buffer must be done before it is overwritten
            # (the runner synchronises every step, so this returns at once)
            self._copied.synchronize()
        width = fill_decode_inputs(self.staging, chunks, input_ids, b, self.page_size, self.max_pages)
        packed = self.staging[:packed_len(b, width)].to(self.device, non_blocking=True)
        load_decode_inputs(self.static, packed, b, width)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return b

    def forward(self, bucket: int) -> torch.Tensor:
        """The captured work, run eagerly on the static inputs: forward + LM head of all `bucket` rows into
        the static logits buffer. -> logits [bucket, vocab] (a view)."""
        hidden = self.model(self.static.input_ids(bucket), self._metas[bucket], self.kv)
        out = self.logits[:bucket]
        out.copy_(self.model.compute_logits(hidden))
        return out

    def replay(self, bucket: int) -> torch.Tensor:
        self._graphs[bucket].replay()
        return self.logits[:bucket]

    def run(self, chunks: Sequence[ChunkSpec], input_ids: Sequence[int]) -> torch.Tensor:
        """One decode step through its bucket's graph -> logits [len(chunks), vocab] (a view)."""
        b = self.prepare(chunks, input_ids)
        return self.replay(b)[:len(chunks)]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, into one shared memory pool; returns the seconds it took.

        Each bucket first runs eagerly once (Triton compiles its kernels and the kernels' arrival-counter buffers
        reach their size outside the capture). The static inputs hold padding rows only while capturing, so
        neither run writes the KV pool."""
        if self.device.type != "cuda":
            raise RuntimeError(f"DecodeGraphs.capture: CUDA graphs need a CUDA device, not {self.device}")
        t0 = time.perf_counter()
        reserved0 = torch.cuda.memory_reserved(self.device)
        self._pad_all()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self.forward(b)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's unsafe CUDA calls break the capture; a server's other threads
            # (metrics, KV transfer) may keep calling the runtime meanwhile
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.forward(b)
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved0
        return self.capture_seconds

    def _pad_all(self) -> None:
        s = self.static
        s.tokens[:2].zero_()
        s.tokens[2].fill_(-1)
        s.context_lens.fill_(1)
        s.page_tables.zero_()


__all__ = ["DEFAULT_MAX_CAPTURE", "default_batch_sizes", "capture_sizes", "pick_bucket", "graph_skip_reason",
           "plan_dp_step",
           "is_graph_step", "packed_len", "fill_decode_inputs", "StaticInputs", "load_decode_inputs",
           "DecodeGraphs"]
