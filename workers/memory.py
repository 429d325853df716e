"""Device memory of one shard: the profile step that sizes the KV pool, and what a step that ran out of memory does.

Why a profile (vLLM does the same): the pool used to take `gpu_memory_utilization` of the memory free after the
weights, so a large prefill step had only the small remainder for its activations, and a long prompt crashed the
engine with CUDA OOM. Now, before the pool exists, the runner runs the largest step the scheduler can make:
`max_num_batched_tokens` prompt tokens as prefill chunks from position 0 (one chunk, or several requests'
when `max_model_len` is shorter), then the LM head and the sampler on min(max_num_seqs, tokens) rows, over a
temporary KV cache just big enough for those tokens (freed afterwards). Its peak activation memory is kept free:

    pool bytes = free * gpu_memory_utilization - peak activation - decode graph reserve

* `free`: the device's free memory (cudaMemGetInfo) after the weights are loaded, the profile ran and its cache
  and torch's cached blocks were released. So `gpu_memory_utilization` stays what it meant before: the fraction
  of the memory this engine finds free after its weights (the remaining 1 - u is headroom for what torch does not
  allocate: NCCL buffers, cuBLAS workspaces, fragmentation). vLLM's is a fraction of the device total
  (total * u - weights - peak - non-torch); with one engine per GPU the two differ by (1 - u) * weights.
* `peak activation`: torch's max_memory_allocated during the profile, above what was allocated before it.
* `decode graph reserve`: the CUDA graphs are captured after the pool (they hold its addresses), into a private
  memory pool an eager step cannot reuse, so their memory is estimated here and kept free too: one decode forward
  of the largest captured batch, taken as the profile forward's activations per token times that batch, plus the
  profile's LM head and sampler (computed on at least as many rows as the largest batch), and at least
  `GRAPH_RESERVE_FLOOR` (256 MiB). The runner logs the graphs' measured pool next to this estimate and warns when
  it was exceeded.

A step that raises `torch.OutOfMemoryError` anyway (a step shape the profile did not cover) fails only its own
requests: the runner frees torch's cached blocks and raises `StepOutOfMemoryError`; the engine reports those
requests finished with the error and keeps serving (workers/engine.py).

The CUDA readings are isolated in `measure_profile`; the profile step itself (`run_profile_step`) and the
arithmetic (`pages_from_profile`, `graph_reserve_bytes`, `check_pool_holds_max_model_len`) run anywhere, so the
tests exercise them on CPU.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from kernels.prefill_sparse_split import BLOCK_MAJOR_RULE, release_workspace, workspace_bytes
from msa.config import M3Config
from msa.kv_cache import KVCache
from msa.metadata import ChunkSpec, build_metadata
from msa.parallel import ParallelContext
from workers.config import EngineConfig
from workers.request import SamplingParams, StepFailedError
from workers.sampler import Sampler, SamplingBatch

logger = logging.getLogger("m3serve.memory")

# The decode graphs' memory has a part that does not scale with the model: measured on an H200, the 9 default
# graphs (batch 1-64) took 36 MiB for the tiny model and 62 MiB at m3-slice shapes with 16 experts
# (docs/benchmarks.md), where the per-token estimate of `graph_reserve_bytes` gave the tiny model 2.3 MiB.
# Kept free at least (0.2% of an H200).
GRAPH_RESERVE_FLOOR = 256 * 2**20

# The profile's rows sample with every stage on (top-k, top-p, top logprobs): the sampler's largest temporaries.
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=20)


class StepOutOfMemoryError(RuntimeError):
    """A step ran out of device memory; the runner released what it could. Only that step's requests fail."""


@dataclass(frozen=True, kw_only=True)
class StepPeaks:
    """What the profile step allocated above what was allocated before each phase, in bytes (0 where not
    measured)."""

    num_tokens: int  # prompt tokens the profile forward ran
    num_rows: int  # rows that went through the LM head and the sampler
    forward: int  # peak of the model forward, its output hidden states included
    head: int  # peak of the LM head + sampler above what was allocated when they started
    hidden: int  # the forward's output hidden states (held while the head runs)

    @property
    def activation(self) -> int:
        """The step's peak above weights and pool."""
        return max(self.forward, self.hidden + self.head)


@dataclass(frozen=True, kw_only=True)
class MemoryProfile:
    """CUDA readings around the profile step, in bytes."""

    weights: int  # torch memory allocated before the profile (the weights, mostly)
    free: int  # device free memory after the profile, its cache and torch's cached blocks released
    total: int  # device total memory
    peaks: StepPeaks


def profile_chunks(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Chunk lengths of the largest prefill step the scheduler can make: `num_tokens` (max_num_batched_tokens)
    prompt tokens, no chunk past max_model_len - 1 tokens (a prompt leaves room for one generated token) and no
    more chunks than max_num_seqs."""
    per_chunk = max(max_model_len - 1, 1)
    num_tokens = min(num_tokens, per_chunk * max_num_seqs)
    chunks = [per_chunk] * (num_tokens // per_chunk)
    if num_tokens % per_chunk:
        chunks.append(num_tokens % per_chunk)
    return chunks


class _NoMeter:
    """Readings where the device has none to give (CPU): the profile step still runs, measuring nothing."""

    def start(self) -> None:
        pass

    def peak(self) -> int:
        return 0


class _CudaMeter:
    """torch's peak allocation on one CUDA device above where `start` found it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


@torch.inference_mode()
def run_profile_step(model, config: M3Config, engine_config: EngineConfig, *, device: torch.device,
                     dtype: torch.dtype, ctx: ParallelContext | None = None, meter=None) -> StepPeaks:
    """Run the profile step (see the module docstring) on a temporary KV cache; the shard's own pool, if any,
    is not touched. Every rank of a worker group runs it at startup with the same shapes, so its collectives
    match. `meter`: start() / peak() around each phase (None: measure nothing)."""
    meter = meter or _NoMeter()
    page_size = config.page_size
    max_len = min(engine_config.max_model_len, config.max_position_embeddings)  # what the engine schedules
    lengths = profile_chunks(engine_config.max_num_batched_tokens, max_len, engine_config.max_num_seqs)
    chunks, next_page = [], 0
    for n in lengths:
        pages = -(-n // page_size)
        chunks.append(ChunkSpec(list(range(next_page, next_page + pages)), 0, n, False))
        next_page += pages
    kv = KVCache.allocate(config, next_page, device=device, dtype=dtype, ctx=ctx)
    num_tokens = sum(lengths)
    # arbitrary valid ids from a generator of its own (the global and the sampler's RNG stay untouched)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=gen, dtype=torch.int64).to(device)
    meta = build_metadata(chunks, page_size, device)
    meter.start()
    hidden = model(input_ids, meta, kv)
    forward = meter.peak()
    rows = min(engine_config.max_num_seqs, num_tokens)
    meter.start()
    logits = model.compute_logits(hidden[num_tokens - rows:])
    batch = SamplingBatch.build([_PROFILE_PARAMS] * rows, [[]] * rows, [[]] * rows, [None] * rows, device)
    Sampler(torch.Generator(device=device).manual_seed(0))(logits, batch)
    head = meter.peak()
    return StepPeaks(num_tokens=num_tokens, num_rows=rows, forward=forward, head=head,
                     hidden=hidden.numel() * hidden.element_size())


def measure_profile(model, config: M3Config, engine_config: EngineConfig, *, device: torch.device,
                    dtype: torch.dtype, ctx: ParallelContext | None = None) -> MemoryProfile:
    """CUDA: run the profile step and read the memory around it. A profile that runs out of memory itself
    fails startup, naming what to lower."""
    release_cached_memory(device)
    weights = torch.cuda.memory_allocated(device)
    try:
        peaks = run_profile_step(model, config, engine_config, device=device, dtype=dtype, ctx=ctx,
                                 meter=_CudaMeter(device))
        failed = None
    except torch.OutOfMemoryError as e:
        failed = str(e).splitlines()[0] if str(e) else "out of memory"
    release_cached_memory(device)  # outside the except block: the failed forward's tensors are gone by now
    if failed is not None:
        raise RuntimeError(f"max_num_batched_tokens: the profile step of {engine_config.max_num_batched_tokens} "
                           f"tokens ran out of device memory after the weights took {_gib(weights)} "
                           f"({failed}); lower max_num_batched_tokens (or use more GPUs)")
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(weights=weights, free=free, total=total, peaks=peaks)


def graph_reserve_bytes(peaks: StepPeaks, max_graph_batch: int | None) -> int:
    """Memory kept free for the decode CUDA graphs (None: this shard captures none): one decode forward of the
    largest captured batch, at the profile forward's activation bytes per token, plus the profile's LM head and
    sampler (its rows are at least the largest batch: both are capped by max_num_seqs); at least
    `GRAPH_RESERVE_FLOOR`, what the graphs take whatever the model (static buffers, per-graph overhead)."""
    if max_graph_batch is None or peaks.num_tokens == 0:
        return 0
    per_token = -(-peaks.forward // peaks.num_tokens)
    return max(per_token * min(max_graph_batch, peaks.num_tokens) + peaks.head, GRAPH_RESERVE_FLOOR)


def block_major_reserve(config: M3Config, engine_config: EngineConfig, num_kv_heads: int, itemsize: int) -> int:
    """Memory kept free for the block-major sparse prefill's workspace (kernels/prefill_sparse_split.py): the
    profile step's prompt rows may take the token-major kernel or the dense route (which one depends on its
    rows and page-table width, `prompt_kind`), so its peak need not hold the partials a prompt chunk beside a
    long context allocates (up to 512 MiB at M3's shapes; kept from call to call once taken); kept free either
    way (where the profile step did go block-major, counted twice: at most 512 MiB of KV pool). 0 for a model
    without sparse layers. `num_kv_heads`: this shard's."""
    if not config.sparse_layers:
        return 0
    rows = min(engine_config.max_num_batched_tokens,
               BLOCK_MAJOR_RULE["max_rows_per_request"] * engine_config.max_num_seqs)
    return workspace_bytes(rows, num_kv_heads, config.index_topk_blocks,
                           config.num_attention_heads // config.num_key_value_heads, config.head_dim, itemsize)


def pages_from_profile(profile: MemoryProfile, *, utilization: float, bytes_per_page: int,
                       graph_reserve: int = 0) -> int:
    """Pages of the KV pool: (free * utilization - peak activation - graph reserve) // bytes per page, >= 0."""
    budget = int(profile.free * utilization) - profile.peaks.activation - graph_reserve
    return max(budget, 0) // bytes_per_page


def pool_too_small(num_pages: int, page_size: int, max_model_len: int) -> str | None:
    """Why a pool of `num_pages` cannot hold one max_model_len sequence, or None when it can. The last generated
    token is never written to the cache (the scheduler's rule too), so max_model_len - 1 tokens must fit."""
    need = -(-(max_model_len - 1) // page_size)
    if num_pages >= need:
        return None
    return (f"max_model_len: the KV pool holds {num_pages} pages of {page_size} tokens ({num_pages * page_size} "
            f"tokens), fewer than the {need} pages one sequence of max_model_len={max_model_len} tokens needs")


def check_pool_holds_max_model_len(num_pages: int, page_size: int, max_model_len: int, *,
                                   explicit: bool) -> None:
    """Startup check (vLLM's): a pool sized from a memory budget that cannot hold one max_model_len sequence is
    an error naming max_model_len and the pool size. An explicit `num_pages` is the operator's exact choice
    (tests use small pools): it only warns, and the scheduler refuses the requests that could never fit."""
    why = pool_too_small(num_pages, page_size, max_model_len)
    if why is None:
        return
    if explicit:
        logger.warning("%s (num_pages is set: requests that cannot fit are refused)", why)
        return
    raise ValueError(f"{why}; raise gpu_memory_utilization (kv_cache_bytes on CPU), or lower max_model_len or "
                     f"max_num_batched_tokens")


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OOM or the runner's, also as it comes back from a shard actor (Ray's task error keeps the cause's
    class where it can, and the cause itself in `.cause`)."""
    cause = getattr(error, "cause", None)
    return any(isinstance(e, (torch.OutOfMemoryError, StepOutOfMemoryError)) for e in (error, cause))


def step_failure(error: BaseException, *, num_tokens: int, num_requests: int) -> StepFailedError:
    """What the requests of a failed step are told."""
    if is_out_of_memory(error):
        return StepFailedError(f"the engine ran out of GPU memory in this step ({num_tokens} tokens, "
                               f"{num_requests} requests); try a shorter prompt or lower max_num_batched_tokens",
                               out_of_memory=True)
    cause = getattr(error, "cause", None)
    error = cause if isinstance(cause, BaseException) else error
    lines = str(error).strip().splitlines()
    return StepFailedError(f"the engine step failed ({num_tokens} tokens, {num_requests} requests): "
                           f"{type(error).__name__}: {lines[0] if lines else ''}")


def release_cached_memory(device: torch.device) -> None:
    """Give torch's cached, unused device blocks back (after a failed or a profile step), the sparse prefill's kept
    workspace with them."""
    if device.type == "cuda":
        release_workspace()
        gc.collect()
        torch.cuda.empty_cache()


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def describe(profile: MemoryProfile, *, utilization: float, graph_reserve: int, num_pages: int,
             bytes_per_page: int) -> str:
    """The sizing in one log line."""
    p = profile.peaks
    return (f"KV pool {num_pages} pages = {_gib(num_pages * bytes_per_page)}: weights {_gib(profile.weights)}, "
            f"profile step of {p.num_tokens} tokens ({p.num_rows} sampled rows) peaked at {_gib(p.activation)} of "
            f"activations, {_gib(graph_reserve)} kept for decode graphs and the sparse prefill workspace, "
            f"{_gib(profile.free)} free of {_gib(profile.total)} x gpu_memory_utilization {utilization:g}")
