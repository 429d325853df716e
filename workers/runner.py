"""The model runner: owns one shard's model and KV pages on one device, runs a step's forward and samples.

The runner is what a `ShardWorker` actor wraps; with one shard the engine may call it in-process. In a worker
group (`ctx` with tp/ep/dp > 1) every tp rank of a dp rank runs the same batch; only tp rank 0 samples (the
logits are gathered over tp on every rank, so the others would only repeat it) and its result is the one the
engine reads. A dp rank without work still runs an empty forward when its MoE collectives span other dp ranks
(`ctx.dp_ranks_in_lockstep`), so no peer waits forever.

Pure-decode steps replay a CUDA graph of their padded batch size where the shard can capture them
(workers/cuda_graph.py: CUDA, tp = 1 unless `cuda_graph_tp`, ep = 1 unless the capacity MoE dispatch,
`enforce_eager` off); the graphs are captured here at startup, after the KV pool is allocated, and the capture
time is logged. Every other step runs eagerly. Lockstep dp ranks with the capacity dispatch first exchange
their step sizes over the dp group (one small collective and host read per step, outside any graph): every
rank then replays the same bucket, padding up to it, or runs eagerly with buffers sized for the largest step
(`plan_dp_step`).

Memory (workers/memory.py): on CUDA the KV pool is sized after a profile step of `max_num_batched_tokens` prompt
tokens, so the activations of the largest step stay free; a step that still runs out of memory raises
`StepOutOfMemoryError` after releasing torch's cached blocks, and the engine fails only that step's requests.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from msa.config import M3Config, load_config
from msa.kv_cache import KVCache
from msa.metadata import Stager, build_metadata, host_metadata
from msa.model import load_model
from msa.parallel import ParallelContext, all_gather
from workers.batch import StepBatch, logits_row_of_chunk, resolve_batch, rows_token_bitmask
from workers.batch_delta import SeqMirror
from workers.config import EngineConfig
from workers.cuda_graph import DecodeGraphs, capture_sizes, graph_skip_reason, is_graph_step, plan_dp_step
from workers.memory import (StepOutOfMemoryError, block_major_reserve, check_pool_holds_max_model_len, describe,
                            graph_reserve_bytes, measure_profile, pages_from_profile, release_cached_memory)
from workers.sampler import (Sampler, SamplerOutput, SamplingBatch, gather_logprobs, make_generator,
                             skip_draws)

if TYPE_CHECKING:
    from workers.kv.commands import KVEvents

logger = logging.getLogger("m3serve.runner")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(engine_dtype: str, config: M3Config, device: torch.device) -> torch.dtype:
    """'auto' = the checkpoint's dtype on an accelerator, float32 on CPU (CPU bf16 matmuls are slow and the
    CPU tier exists to check exactness)."""
    if engine_dtype != "auto":
        return _DTYPES[engine_dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(config.torch_dtype, torch.bfloat16)


def kv_pool_pages(config: M3Config, engine_config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  ctx: ParallelContext | None = None, model=None) -> tuple[int, int]:
    """(pages of this shard's KV pool, bytes kept free for the decode graphs). Call after loading weights.

    `num_pages` if set (exact, no profile). On CUDA, vLLM's way (workers/memory.py says why and how): `model`
    runs one profile step of `max_num_batched_tokens` prompt tokens (+ the LM head and sampler on up to
    `max_num_seqs` rows) on a temporary cache, and the pool gets
    `free * gpu_memory_utilization - peak activation - decode graph reserve`, where `free` is the device memory
    free after the weights (and the profile, released); note it is a fraction of the free memory, not of the
    device total as in vLLM. Elsewhere the `kv_cache_bytes` budget. A pool sized from a budget that cannot hold
    one `max_model_len` sequence raises ValueError naming both (an explicit `num_pages` only warns)."""
    ctx = ctx or ParallelContext.single()
    page_size = config.page_size
    max_len = min(engine_config.max_model_len, config.max_position_embeddings)  # what the engine schedules
    if engine_config.num_pages is not None:
        check_pool_holds_max_model_len(engine_config.num_pages, page_size, max_len, explicit=True)
        return engine_config.num_pages, 0
    per_page = KVCache.bytes_per_page(config, dtype, ctx)
    reserve = 0
    if device.type == "cuda":
        profile = measure_profile(model, config, engine_config, device=device, dtype=dtype, ctx=ctx)
        graphs = graph_skip_reason(engine_config, device, tp_size=ctx.tp_size, ep_size=ctx.ep_size,
                                   moe_dispatch=ctx.moe_dispatch) is None
        reserve = graph_reserve_bytes(profile.peaks, capture_sizes(engine_config)[-1] if graphs else None)
        kept = reserve + block_major_reserve(config, engine_config, ctx.kv_head_range(config.num_key_value_heads)[1],
                                             torch.empty((), dtype=dtype).element_size())
        util = engine_config.gpu_memory_utilization
        pages = pages_from_profile(profile, utilization=util, bytes_per_page=per_page, graph_reserve=kept)
        sizing = describe(profile, utilization=util, graph_reserve=kept, num_pages=pages, bytes_per_page=per_page)
        logger.info("rank %d: %s", ctx.world_rank, sizing)
        if pages < 1:
            raise ValueError(f"gpu_memory_utilization: no KV page is left after the weights and the profile step "
                             f"({sizing}); raise it, or lower max_num_batched_tokens")
    else:
        budget = engine_config.kv_cache_bytes
        pages = budget // per_page
        if pages < 1:
            raise ValueError(f"kv_cache_bytes: the KV budget ({budget} B) holds no page of {per_page} B")
    check_pool_holds_max_model_len(pages, page_size, max_len, explicit=False)
    return pages, reserve


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What a shard returns for a step: one entry per `StepBatch.rows` row."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: sampled token + top-N, None where not requested
    forward_time: float  # seconds in the forward, logits and the sampler's kernels (device synchronised)
    sample_time: float  # seconds reading the sampled tokens and logprobs back into lists
    # per StepBatch.prompt_logprob_chunks entry: {target token: logprob, + top-N} for each of its targets
    prompt_logprobs: list[list[dict[int, float]]] = ()
    kv: KVEvents | None = None  # the shards' answer to the batch's KV commands (workers/kv/commands.py)


class StagerRing:
    """`Stager`s taken in turn: a `Stager` waits for its previous copy before it rewrites its pinned buffer, and
    with a step in flight that copy may sit behind the whole step on the stream. A step stages a few times (its
    metadata, sampling parameters, deferred ids, prompt-logprob targets); the ring is long enough that a buffer
    comes round again only after the step that used it was read back."""

    def __init__(self, device, size: int = 8) -> None:
        self._stagers = [Stager(device) for _ in range(size)]
        self._next = 0

    def stage(self, lists):
        stager = self._stagers[self._next]
        self._next = (self._next + 1) % len(self._stagers)
        return stager.stage(lists)


class StepHandle:
    """A launched step (`ModelRunner.launch`). On CUDA the sampled ids (and the logprobs asked for) are copied to
    pinned host memory behind the step's kernels, then an event is recorded; `result()` waits for that event
    only, so a step launched after this one keeps the device busy meanwhile (reading a device tensor instead
    would wait for that one too)."""

    def __init__(self, device: torch.device, t0: float, sampled, prompt_logprobs: list,
                 num_logprobs: list[int | None]) -> None:
        self._t0 = t0
        self._num_logprobs = num_logprobs
        self._sampled = self._plp = None
        self._event = None
        self._result: StepResult | None = None
        if sampled is not None:
            out = sampled[0]
            wanted = any(k is not None for k in num_logprobs)
            self._sampled = _to_host(out if wanted else dataclasses.replace(
                out, logprobs=out.logprobs[:0], top_token_ids=out.top_token_ids[:0], top_logprobs=out.top_logprobs[:0]))
        self._plp = [(pc, _to_host(o)) for pc, o in prompt_logprobs]
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._ready = time.perf_counter()  # on the CPU the step ran in launch: it is done now

    @classmethod
    def done(cls, result: StepResult) -> StepHandle:
        handle = cls.__new__(cls)
        handle._result = result
        return handle

    def result(self) -> StepResult:
        """Wait for the step's device work and read its outputs (once; later calls return the same)."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
            self._ready = time.perf_counter()
        token_ids: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        if self._sampled is not None:
            token_ids = self._sampled.token_ids.tolist()
            logprobs = self._sampled.logprob_dicts(self._num_logprobs) \
                if any(k is not None for k in self._num_logprobs) else [None] * len(token_ids)
        prompt_lps = [o.logprob_dicts([pc.num_top] * len(pc.target_ids)) for pc, o in self._plp]
        self._result = StepResult(token_ids=token_ids, logprobs=logprobs, forward_time=self._ready - self._t0,
                                  sample_time=time.perf_counter() - self._ready, prompt_logprobs=prompt_lps)
        self._sampled = self._plp = None
        return self._result


def _to_host(out: SamplerOutput) -> SamplerOutput:
    """The sampler's tensors copied to pinned host memory without waiting (CPU tensors are returned as they are)."""
    if out.token_ids.device.type == "cpu":
        return out

    def copy(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    return SamplerOutput(token_ids=copy(out.token_ids), logprobs=copy(out.logprobs),
                         top_token_ids=copy(out.top_token_ids), top_logprobs=copy(out.top_logprobs))


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, engine_config: EngineConfig, device: str | torch.device = "cpu",
                 ctx: ParallelContext | None = None) -> None:
        self.ctx = ctx or ParallelContext.single()
        # tp rank 0 samples for its dp rank; the other tp ranks only join the forward's collectives
        self.samples = self.ctx.tp_rank == 0
        self.num_idle_forwards = 0  # empty-batch forwards run to keep a lockstep dp group's collectives matched
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        config = load_config(model_dir)
        self.dtype = resolve_dtype(engine_config.dtype, config, self.device)
        logger.info("rank %d: running in %s on %s (checkpoint dtype %s, engine dtype %r)", self.ctx.world_rank,
                    str(self.dtype).removeprefix("torch."), self.device, config.torch_dtype, engine_config.dtype)
        self.model = load_model(model_dir, device=self.device, dtype=self.dtype, ctx=ctx)
        self.config = self.model.config
        backend = engine_config.attention_backend
        self.model.set_attention_backend(None if backend == "auto" else backend)
        self.num_pages, self._graph_reserve = kv_pool_pages(self.config, engine_config, self.device, self.dtype,
                                                            ctx, model=self.model)
        self.kv = KVCache.allocate(self.config, self.num_pages, device=self.device, dtype=self.dtype, ctx=ctx)
        self.page_size = self.kv.page_size
        # Unseeded rows draw from this engine-seeded generator; seeded rows get their own (see sampler).
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(engine_config.seed))
        self._generators: dict[int, torch.Generator] = {}
        # the page tables (and penalty rows' token ids) of the sequences this shard runs: batches carry only what
        # changed since the batch before (workers/batch_delta.py)
        self.seq_mirror = SeqMirror()
        # the steps' inputs: pinned buffers, one copy each; a ring, so the step launched while another still
        # runs never waits for that one's copies (async scheduling)
        self._stager = StagerRing(self.device)
        self._last_sampled: torch.Tensor | None = None  # the sampled ids of the step launched last (on the device)
        self.num_graph_steps = 0  # steps run by replaying a decode graph (tests and benchmarks read it)
        self.graphs: DecodeGraphs | None = self._capture_graphs(engine_config)

    def _capture_graphs(self, engine_config: EngineConfig) -> DecodeGraphs | None:
        """Decode graphs for every bucket, captured now (workers/cuda_graph.py says why at startup), or None
        where this shard cannot hold a forward in a graph."""
        skip = graph_skip_reason(engine_config, self.device, tp_size=self.ctx.tp_size, ep_size=self.ctx.ep_size,
                                 moe_dispatch=self.ctx.moe_dispatch)
        if skip is not None:
            logger.info("rank %d: decode steps run eagerly: %s", self.ctx.world_rank, skip)
            return None
        graphs = DecodeGraphs(self.model, self.kv, sizes=capture_sizes(engine_config),
                              max_model_len=engine_config.max_model_len, device=self.device)
        seconds = graphs.capture()
        logger.info("rank %d: captured %d decode CUDA graphs (batch sizes %s, %d table pages) in %.2f s, %.1f MiB "
                    "(%.1f MiB kept for them when the KV pool was sized)", self.ctx.world_rank, len(graphs.sizes),
                    list(graphs.sizes), graphs.max_pages, seconds, graphs.pool_bytes / 2**20,
                    self._graph_reserve / 2**20)
        if engine_config.num_pages is None and graphs.pool_bytes > self._graph_reserve:
            logger.warning("rank %d: the decode graphs took %.1f MiB, more than the %.1f MiB estimated when the KV "
                           "pool was sized: eager steps have that much less headroom than the profile step needed",
                           self.ctx.world_rank, graphs.pool_bytes / 2**20, self._graph_reserve / 2**20)
        return graphs

    def info(self) -> dict:
        ctx = self.ctx
        return {"num_pages": self.num_pages, "page_size": self.page_size, "dtype": str(self.dtype),
                "device": str(self.device),
                "kv_bytes": self.num_pages * KVCache.bytes_per_page(self.config, self.dtype, ctx),
                "rank": ctx.world_rank, "tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "ep_rank": ctx.ep_rank,
                "cuda_graph_sizes": list(self.graphs.sizes) if self.graphs is not None else [],
                "cuda_graph_capture_s": self.graphs.capture_seconds if self.graphs is not None else None}

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step and wait for it. Out of device memory: torch's cached blocks are released and
        `StepOutOfMemoryError` raised (the engine fails this step's requests and goes on); the runner stays
        usable."""
        return self.launch(batch).result()

    def launch(self, batch: StepBatch) -> StepHandle:
        """Start one step and return without waiting for the device (async scheduling): its inputs staged, the
        forward, the sampler, and the copies of what the host reads back are queued; `result()` waits for them.
        On the CPU the work runs here. A batch with `deferred_positions` takes those input ids from the sampled
        ids of the step launched just before it. Errors as `execute`."""
        try:
            return self._launch(batch)
        except torch.OutOfMemoryError as e:
            why = str(e).splitlines()[0] if str(e) else "out of memory"
        # past the except block: the failed forward's frames (and the tensors they held) are gone, so the
        # cache can really be emptied
        release_cached_memory(self.device)
        raise StepOutOfMemoryError(f"out of {self.device.type} memory in a step of {batch.num_tokens} tokens "
                                   f"({len(batch.chunks)} requests): {why}")

    @torch.inference_mode()
    def _launch(self, batch: StepBatch) -> StepHandle:
        for sid in batch.released_seq_ids:
            self._generators.pop(sid, None)
        batch = resolve_batch(batch, self.seq_mirror)
        graph = self.graphs is not None and is_graph_step(batch, self.graphs.max_batch)
        group_tokens = bucket = None
        if self.ctx.dp_ranks_in_lockstep and self.ctx.moe_dispatch == "capacity":
            group_tokens, bucket = self._plan_dp_step(batch, graph)
            graph = bucket is not None
        if not batch.chunks:
            self._last_sampled = None
            return StepHandle.done(self._idle_step(group_tokens, bucket))
        t0 = time.perf_counter()
        if graph:
            # one row per decode chunk, every row sampled in chunk order: the graph's logits rows are the rows
            bucket = self.graphs.prepare(batch.chunks, batch.input_ids, bucket=bucket)
            if batch.deferred_positions:
                self._fill_deferred(self.graphs.static.input_ids(bucket), batch)
            logits, plp_rows = self.graphs.replay(bucket)[:len(batch.chunks)], []
            self.num_graph_steps += 1
        else:
            logits, plp_rows = self._eager_logits(batch, group_tokens)
        sampled = None
        self._last_sampled = None
        if self.samples and batch.rows:
            # queued behind the forward (staged inputs, no sync): the host builds it while the GPU still runs
            sampled = self._sample(logits[:len(batch.rows)], batch)
            self._last_sampled = sampled[0].token_ids
        if not self.samples:
            return StepHandle(self.device, t0, None, [], [])
        plp = [(pc, self._prompt_logprob_tensors(logits[r:r + len(pc.target_ids)], pc))
               for r, pc in zip(plp_rows, batch.prompt_logprob_chunks)]
        return StepHandle(self.device, t0, sampled, plp, [r.params.logprobs for r in batch.rows])

    def _fill_deferred(self, input_ids: torch.Tensor, batch: StepBatch) -> None:
        """Async scheduling: the ids the host does not know yet, from the previous step's sampled ids, on the
        device (no host round trip: the copy is queued behind that step's sampler)."""
        prev = self._last_sampled
        if prev is None or max(batch.deferred_rows) >= prev.shape[0]:
            raise RuntimeError("deferred input ids name rows the previous step did not sample")
        pos, rows = self._stager.stage([(batch.deferred_positions, torch.int64), (batch.deferred_rows, torch.int64)])
        input_ids[pos] = prev[rows]

    def _plan_dp_step(self, batch: StepBatch, graph: bool) -> tuple[int, int | None]:
        """Lockstep dp ranks with the capacity MoE dispatch: exchange (tokens, graph rows or -1) over the dp
        group and plan the step every rank runs (`plan_dp_step`): the same bucket everywhere, or eager with
        the MoE buffers sized for the largest step."""
        rows = len(batch.chunks) if graph or not batch.chunks else -1
        mine = torch.tensor([[batch.num_tokens, rows]], dtype=torch.int64, device=self.device)
        per_rank = [(t, None if r < 0 else r) for t, r in all_gather(mine, self.ctx, dim=0, axis="dp").tolist()]
        return plan_dp_step(per_rank, self.graphs.sizes if self.graphs is not None else None)

    def _eager_logits(self, batch: StepBatch, group_tokens: int | None = None
                      ) -> tuple[torch.Tensor | None, list[int]]:
        """The step's forward run eagerly -> (logits [sampled rows + prompt-logprob targets, vocab] fp32 or None,
        the first logits row of each prompt-logprob chunk). The step's inputs reach the device in one staged copy
        that never waits for the GPU (msa.metadata.Stager)."""
        host = host_metadata(batch.chunks, self.page_size)
        first, last = logits_row_of_chunk(batch.chunks)
        # Only the sampling chunks (and prompt-logprob chunks) need the LM head, not every chunk's last token.
        want = [last[i] for i in batch.sample_chunks]
        plp_rows = []
        for pc in batch.prompt_logprob_chunks:
            plp_rows.append(len(want))
            want.extend(range(first[pc.chunk_index], first[pc.chunk_index] + len(pc.target_ids)))
        rows = host.logits_indices[np.asarray(want, dtype=np.int64)]
        meta, (input_ids, rows_t) = host.to_device(self._stager, extra=[(batch.input_ids, torch.int64),
                                                                       (rows, torch.int64)])
        if batch.deferred_positions:
            self._fill_deferred(input_ids, batch)
        if group_tokens is not None:
            meta = dataclasses.replace(meta, moe_group_tokens=group_tokens)
        hidden = self.model(input_ids, meta, self.kv)
        logits = self.model.compute_logits(hidden[rows_t]) if want else None
        return logits, plp_rows

    def _idle_step(self, group_tokens: int | None = None, bucket: int | None = None) -> StepResult:
        """No work for this dp rank this step: run an empty forward only if peers in other dp ranks need this
        rank in their MoE collectives (a bucket of padding rows when they replay a graph)."""
        if not self.ctx.dp_ranks_in_lockstep:
            return StepResult(token_ids=[], logprobs=[], forward_time=0.0, sample_time=0.0, prompt_logprobs=[])
        t0 = time.perf_counter()
        if bucket is not None:
            self.graphs.replay(self.graphs.prepare([], [], bucket=bucket))
            self.num_graph_steps += 1
        else:
            meta = dataclasses.replace(build_metadata([], self.page_size, self.device), moe_group_tokens=group_tokens)
            self.model(torch.empty(0, dtype=torch.int64, device=self.device), meta, self.kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.num_idle_forwards += 1
        return StepResult(token_ids=[], logprobs=[], forward_time=time.perf_counter() - t0, sample_time=0.0,
                          prompt_logprobs=[])

    def _prompt_logprob_tensors(self, logits: torch.Tensor, pc) -> SamplerOutput:
        targets = self._stager.stage([(pc.target_ids, torch.int64)])[0]
        chosen, top_ids, top_lps = gather_logprobs(logits, targets, pc.num_top)
        return SamplerOutput(token_ids=targets, logprobs=chosen, top_token_ids=top_ids, top_logprobs=top_lps)

    def _sample(self, logits: torch.Tensor, batch: StepBatch):
        rows = batch.rows
        params = [r.params for r in rows]
        generators = [self._generator(r, logits.shape[-1]) for r in rows]
        sb = SamplingBatch.build(params, [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows],
                                 generators, self.device, suppressed_ids=[r.suppressed_ids for r in rows],
                                 token_bitmask=rows_token_bitmask(batch), stage=self._stager.stage)
        return self.sampler(logits, sb), [p.logprobs for p in params]

    def _generator(self, row, vocab_size: int) -> torch.Generator | None:
        if row.params.seed is None:
            return None
        gen = self._generators.get(row.seq_id)
        if gen is None:
            gen = self._generators[row.seq_id] = make_generator(row.params.seed, row.sample_index, self.device)
            # tokens the sample already holds were drawn by another engine (the prefill replica): replay their
            # draws so the next token gets the random numbers an unbroken run would (a preempted request keeps
            # its generator: seq ids are released only when the request ends)
            skip_draws(gen, row.num_output_tokens, vocab_size)
        return gen
