"""KV pool sizing (workers/memory.py): the profile step's arithmetic on made-up CUDA readings, the profile forward
itself on CPU (it runs, leaves the shard's pool and the RNG alone, frees its temporary cache), the max_model_len
startup check, and a step that runs out of memory inside the runner."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from msa.config import load_config
from msa.kv_cache import KVCache
from workers import memory, runner as runner_mod
from workers.batch import build_step_batch
from workers.config import EngineConfig
from workers.memory import (MemoryProfile, StepOutOfMemoryError, StepPeaks, block_major_reserve, graph_reserve_bytes,
                            pages_from_profile, pool_too_small, profile_chunks, run_profile_step)
from workers.pages import PageManager
from workers.request import SamplingParams
from workers.runner import ModelRunner, kv_pool_pages
from workers.scheduler import Scheduler

GIB, MIB = 2**30, 2**20


def test_profile_chunks_are_the_largest_step_the_scheduler_can_make():
    assert profile_chunks(2048, 4096, 64) == [2048]  # one prompt chunk from position 0
    assert profile_chunks(300, 128, 8) == [127, 127, 46]  # no prompt is longer than max_model_len - 1
    assert profile_chunks(1000, 101, 3) == [100, 100, 100]  # nor are there more than max_num_seqs of them
    assert profile_chunks(5, 2, 64) == [1] * 5


def test_pool_pages_keep_the_profile_peak_and_the_graph_reserve_free():
    peaks = StepPeaks(num_tokens=2048, num_rows=64, forward=3 * GIB, head=200 * MIB, hidden=16 * MIB)
    assert peaks.activation == 3 * GIB  # the forward's peak already holds its hidden states
    assert StepPeaks(num_tokens=8, num_rows=8, forward=10, head=30, hidden=5).activation == 35
    profile = MemoryProfile(weights=20 * GIB, free=100 * GIB, total=140 * GIB, peaks=peaks)
    per_page = 2 * MIB
    # free * utilization - peak activation - graph reserve, in whole pages
    assert pages_from_profile(profile, utilization=0.9, bytes_per_page=per_page) == (90 * GIB - 3 * GIB) // per_page
    reserve = graph_reserve_bytes(peaks, 64)
    assert reserve == -(-3 * GIB // 2048) * 64 + 200 * MIB  # one decode forward of 64 rows + the LM head
    small = StepPeaks(num_tokens=2048, num_rows=64, forward=64 * MIB, head=MIB, hidden=MIB)
    assert graph_reserve_bytes(small, 64) == memory.GRAPH_RESERVE_FLOOR == 256 * MIB  # never below the floor
    assert graph_reserve_bytes(peaks, None) == 0  # no graphs captured, nothing kept for them
    assert pages_from_profile(profile, utilization=0.9, bytes_per_page=per_page, graph_reserve=reserve) == \
        (90 * GIB - 3 * GIB - reserve) // per_page
    starved = MemoryProfile(weights=20 * GIB, free=2 * GIB, total=140 * GIB, peaks=peaks)
    assert pages_from_profile(starved, utilization=0.9, bytes_per_page=per_page) == 0


def test_the_cuda_branch_sizes_the_pool_from_the_profile_readings(tiny_ckpt, monkeypatch, caplog):
    """kv_pool_pages on a (pretend) CUDA device: the readings come from measure_profile (faked here: it needs a
    GPU), the pool from the arithmetic above, the graph reserve only when graphs will be captured."""
    config = load_config(tiny_ckpt)
    per_page = KVCache.bytes_per_page(config, torch.bfloat16)
    peaks = StepPeaks(num_tokens=2048, num_rows=64, forward=512 * MIB, head=8 * MIB, hidden=MIB)
    profile = MemoryProfile(weights=GIB, free=4 * GIB, total=8 * GIB, peaks=peaks)
    monkeypatch.setattr(runner_mod, "measure_profile", lambda *a, **kw: profile)
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="m3serve.runner"):
        pages, reserve = kv_pool_pages(config, EngineConfig(max_num_seqs=64), cuda, torch.bfloat16)
    assert reserve == graph_reserve_bytes(peaks, 64) > 0
    workspace = block_major_reserve(config, EngineConfig(max_num_seqs=64), config.num_key_value_heads, 2)
    assert pages == (int(4 * GIB * 0.9) - 512 * MIB - reserve - workspace) // per_page
    assert "weights 1.00 GiB" in caplog.text and "peaked at 0.50 GiB" in caplog.text and f"{pages} pages" in caplog.text
    eager = kv_pool_pages(config, EngineConfig(max_num_seqs=64, enforce_eager=True), cuda, torch.bfloat16)
    assert eager == ((int(4 * GIB * 0.9) - 512 * MIB - workspace) // per_page, 0)
    assert kv_pool_pages(config, EngineConfig(num_pages=7), cuda, torch.bfloat16) == (7, 0)  # exact: no profile
    nothing_left = MemoryProfile(weights=GIB, free=256 * MIB, total=8 * GIB, peaks=peaks)
    monkeypatch.setattr(runner_mod, "measure_profile", lambda *a, **kw: nothing_left)
    with pytest.raises(ValueError, match="gpu_memory_utilization: no KV page is left.*max_num_batched_tokens"):
        kv_pool_pages(config, EngineConfig(), cuda, torch.bfloat16)


def test_a_pool_that_cannot_hold_one_max_model_len_sequence_fails_startup(make_llm, tiny_ckpt, caplog):
    per_page = KVCache.bytes_per_page(load_config(tiny_ckpt))
    assert pool_too_small(16, 16, 257) is None and "max_model_len=258" in pool_too_small(16, 16, 258)
    # 37 pages x 16 tokens = 592 tokens: too few for max_model_len 4096 (vLLM refuses to start there too)
    with pytest.raises(ValueError, match=r"max_model_len: the KV pool holds 37 pages of 16 tokens \(592 tokens\), "
                                         r"fewer than the 256 pages one sequence of max_model_len=4096"):
        make_llm(kv_cache_bytes=per_page * 37, max_model_len=4096)
    assert make_llm(kv_cache_bytes=per_page * 37, max_model_len=593).engine.num_pages == 37  # 592 cached + 1
    # an exact num_pages is the operator's choice: it starts, warns, and the scheduler refuses what cannot fit
    with caplog.at_level(logging.WARNING, logger="m3serve.memory"):
        llm = make_llm(num_pages=8, max_model_len=4096)
    assert "max_model_len=4096" in caplog.text
    with pytest.raises(ValueError, match="prompt_token_ids: the request needs up to"):
        llm.engine.add_request("big", list(range(3, 203)), SamplingParams(max_tokens=1))


class _RecordingMeter:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def peak(self) -> int:
        self.calls.append("peak")
        return 1000 * len(self.calls)


def test_the_profile_forward_runs_on_cpu_and_touches_nothing_of_the_shard(tiny_ckpt, monkeypatch):
    cfg = EngineConfig(num_pages=8, max_model_len=128, max_num_batched_tokens=300, max_num_seqs=4)
    runner = ModelRunner(tiny_ckpt, engine_config=cfg)
    for t in runner.kv.k + runner.kv.v:
        t.normal_()  # the shard's pages hold something a write from the profile would change
    before = [t.clone() for t in runner.kv.k + runner.kv.v + [x for x in runner.kv.index_k if x is not None]]
    rng = torch.random.get_rng_state()
    sampler_rng = runner.sampler.generator.get_state()
    made = []
    allocate = KVCache.allocate.__func__

    def recording_allocate(cls, *args, **kw):  # test-only: watch the profile's temporary cache
        kv = allocate(cls, *args, **kw)
        made.append(weakref.ref(kv.k[0]))
        return kv

    monkeypatch.setattr(KVCache, "allocate", classmethod(recording_allocate))
    meter = _RecordingMeter()
    peaks = run_profile_step(runner.model, runner.config, cfg, device=runner.device, dtype=runner.dtype,
                             meter=meter)
    monkeypatch.undo()
    assert peaks == StepPeaks(num_tokens=300, num_rows=4, forward=2000, head=4000,
                              hidden=300 * runner.config.hidden_size * 4)
    assert meter.calls == ["start", "peak", "start", "peak"]
    # one temporary cache of 8 + 8 + 3 pages (chunks of 127, 127, 46 tokens), gone once the profile returned
    assert len(made) == 1
    gc.collect()
    assert made[0]() is None, "the profile's temporary KV cache is still referenced"
    after = [t for t in runner.kv.k + runner.kv.v + [x for x in runner.kv.index_k if x is not None]]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the profile wrote into the shard's pool"
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert torch.equal(runner.sampler.generator.get_state(), sampler_rng)
    # without a meter (what a CPU shard would use) it runs the same and measures nothing
    quiet = run_profile_step(runner.model, runner.config, cfg, device=runner.device, dtype=runner.dtype)
    assert (quiet.forward, quiet.head, quiet.num_tokens) == (0, 0, 300)


class _OOMModel(torch.nn.Module):
    """Test-only: the runner's model, running out of memory on the forwards `fail` picks (by token count)."""

    def __init__(self, inner, fail_tokens: int) -> None:
        super().__init__()
        self.inner, self.fail_tokens = inner, fail_tokens

    def forward(self, input_ids, meta, kv):
        if input_ids.shape[0] == self.fail_tokens:
            _big = torch.empty(1024)  # something the failed frame holds: gone before the runner re-raises
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner(input_ids, meta, kv)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


def _one_step_batch(cfg: EngineConfig, runner: ModelRunner, prompt: list[int]):
    pages = PageManager(runner.num_pages, runner.page_size)
    sched = Scheduler(cfg, pages)
    sched.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    return build_step_batch(sched.schedule(), pages)


def test_a_forward_out_of_memory_becomes_a_clear_step_error_and_the_runner_goes_on(tiny_ckpt):
    cfg = EngineConfig(num_pages=16, max_model_len=128)
    runner = ModelRunner(tiny_ckpt, engine_config=cfg)
    want = runner.execute(_one_step_batch(cfg, runner, list(range(5, 15)))).token_ids
    runner.model = _OOMModel(runner.model, fail_tokens=20)
    with pytest.raises(StepOutOfMemoryError, match=r"out of cpu memory in a step of 20 tokens \(1 requests\): "
                                                   r"CUDA out of memory") as e:
        runner.execute(_one_step_batch(cfg, runner, list(range(5, 25))))
    assert e.value.__cause__ is None and e.value.__context__ is None  # no frame of the failed forward is kept
    assert memory.is_out_of_memory(e.value)
    assert runner.execute(_one_step_batch(cfg, runner, list(range(5, 15)))).token_ids == want


def test_block_major_workspace_is_kept_free_at_m3_shapes_and_not_for_dense_models(tiny_ckpt):
    """M3 (4 KV heads, top-16, 16 query heads a group, head_dim 128, bf16): a 4,096-row slice's partials (512 MiB)
    plus their lse and work-list ints, whatever the step size above it; a model without sparse layers keeps none."""
    import dataclasses

    from workers.models import preset_config

    m3 = preset_config("m3-slice")
    pairs = 4096 * 4 * 16
    want = pairs * 16 * (128 * 2 + 4) + pairs * 12
    assert block_major_reserve(m3, EngineConfig(max_num_batched_tokens=16384), 4, 2) == want
    assert block_major_reserve(m3, EngineConfig(max_num_batched_tokens=1024), 4, 2) == want // 4
    dense = dataclasses.replace(m3, layer_types=tuple("full_attention" for _ in m3.layer_types))
    assert block_major_reserve(dense, EngineConfig(), 4, 2) == 0


def test_releasing_cached_memory_drops_the_sparse_prefills_kept_workspace(monkeypatch):
    """The block-major kernel keeps its partials and work lists between calls; the engine's OOM recovery and the
    profile step give torch's cache back through `release_cached_memory`, and that must take them too (else a
    recovered engine holds up to 512 MiB more than it sized its pool for)."""
    from kernels import prefill_sparse_split as split

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    split._kept_partials(64, 16, torch.float16, torch.device("cpu"))
    split._kept_work_buffers(32, 8, 4, torch.device("cpu"))
    assert split._PARTIALS and split._WORK
    memory.release_cached_memory(torch.device("cpu"))  # a CPU engine has no torch cache to give back
    assert split._PARTIALS and split._WORK and not emptied
    memory.release_cached_memory(torch.device("cuda", 0))
    assert not split._PARTIALS and not split._WORK and emptied
