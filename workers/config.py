"""Engine-side configuration: frozen, keyword-only dataclasses (loaded strictly by `workers.configio`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["unified", "prefill", "decode"]


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Layout of one model instance (worker group): tp * dp shard workers; ep spans them.

    tp: tensor-parallel size (attention heads, dense MLPs, vocab). dp: attention-data-parallel size (each DP rank
    holds its own requests and KV pages). ep: expert-parallel size; experts split over ep ranks, and ep must
    divide tp * dp (EP spans the TP x DP ranks of the group). ep == 1 replicates experts (TP-sharded).
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name}: must be >= 1, got {v}")
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"ep: {self.ep} must divide tp * dp = {self.tp * self.dp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Scheduler, KV pool and batching limits of one engine (one model instance)."""

    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # KV pool size: on GPU a fraction of free device memory after weights; on CPU a byte budget.
    gpu_memory_utilization: float = 0.90
    kv_cache_bytes: int = 64 * 2**20
    num_pages: int | None = None  # exact pool size (tests); overrides both budgets
    enable_prefix_caching: bool = True
    max_waiting: int = 512  # waiting-queue bound; the server answers 429 beyond it
    admission_watermark: float = 0.01  # fraction of pages kept free when admitting new requests
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    # CUDA graphs for pure-decode steps (workers/cuda_graph.py), captured at startup on CUDA (tp = 1, and ep = 1
    # or the capacity MoE dispatch, unless cuda_graph_tp).
    # enforce_eager: never capture (every step eager, like vLLM's flag). cuda_graph_batch_sizes: the padded batch
    # sizes captured, ascending; None = 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to min(max_num_seqs, 512).
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # cuda_graph_tp: also capture where tp > 1 (the graphs then hold NCCL all-reduces). Off until graph replay
    # equals eager on 2 GPUs (issue 24; tests/workers/test_cuda_graph_multigpu.py). ep > 1 captures only with
    # the capacity MoE dispatch (no host read in the forward), and with tp > 1 needs this flag too.
    cuda_graph_tp: bool = False
    # attention and indexer kernels: "auto" = Triton on CUDA; on CPU decode rows batched in torch, prompt rows by
    # the torch references (kernels/attention.py's `_torch_route`); "triton" forces the
    # kernels (on CPU through the Triton interpreter: TRITON_INTERPRET=1 before triton is imported; tests),
    # "ref" the torch references (a check on a GPU; never for serving: they allocate [T, heads, context])
    attention_backend: Literal["auto", "triton", "ref"] = "auto"
    # async scheduling (workers/engine_api.py): schedule step n+1 and launch it while step n runs, its decode
    # rows' input ids taken on the device from n's sampled ids; n's tokens are read back and applied after.
    # In-process executor of a unified engine only; steps with grammar or penalty rows stay synchronous.
    # None: on where the shard runs on CUDA (it hides the host's step work behind the device's; on the CPU the
    # launch itself runs the forward, so there is nothing to hide), off elsewhere.
    async_scheduling: bool | None = None
    # warm-up (workers/warmup.py): before the engine takes requests, a few seconds of synthetic requests of many
    # prompt lengths while others decode, so Triton builds the kernel variants serving meets at startup rather
    # than in a user's step (each a 0.2-2 s stall; docs/benchmarks.md D6). Unified engines only. None: on where
    # the shard runs on CUDA, off on the CPU (no compiles there).
    warmup: bool | None = None
    # prefill_batch_wait_s: while sequences decode, a newly arrived prompt waits up to this long for others to
    # share its prefill step (Ray Serve's `batch_wait_timeout_s`, for prompts): each prompt alone costs a whole
    # prefill step (it reads every expert's weights) that stalls every decoding stream. Never held when nothing
    # decodes, when the waiting prompts fill the step's token budget or the free seats, or a preempted sequence.
    # Off by default: at 5 ms it was neutral on the H200 at 16 streams (docs/benchmarks.md S3), where a wave's
    # arrivals through HTTP spread over 15-50 ms, not a decode step.
    prefill_batch_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError("max_model_len: must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens: must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes: must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages: must be >= 1")
        if not 0.0 <= self.prefill_batch_wait_s <= 10.0:
            raise ValueError("prefill_batch_wait_s: must be in [0, 10] seconds")
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError("admission_watermark: must be in [0, 1)")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            sizes = tuple(sizes)  # a list from Python callers: stored as the tuple the field declares
            object.__setattr__(self, "cuda_graph_batch_sizes", sizes)
            if not sizes or any(b < 1 for b in sizes) or any(a >= b for a, b in zip(sizes, sizes[1:])):
                raise ValueError(f"cuda_graph_batch_sizes: must be a non-empty ascending list of sizes >= 1, "
                                 f"got {list(sizes)}")
            if sizes[-1] > self.max_num_seqs:
                raise ValueError(f"cuda_graph_batch_sizes: {sizes[-1]} exceeds max_num_seqs ({self.max_num_seqs}); "
                                 f"a decode step never holds more rows")
