"""The pure parts of decode CUDA graphs (workers/cuda_graph.py) on CPU: buckets, the config fields and their
loader, eligibility, packing a step into the static buffers, and the padded step (the exact work a graph holds)
run eagerly on CPU against the unpadded eager step. The replay itself is tested on CUDA in
test_cuda_graph_gpu.py."""
from __future__ import annotations

import random

import pytest
import torch

from msa.kv_cache import KVCache
from msa.metadata import ChunkSpec, build_metadata
from workers import cuda_graph as cg
from workers.batch import StepBatch
from workers.config import EngineConfig
from workers.configio import ConfigError, from_dict
from workers.request import SamplingParams


# ---- buckets and config ---------------------------------------------------------------------------------------

def test_default_batch_sizes_are_capped_at_max_num_seqs_and_512():
    assert cg.default_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert cg.default_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # max_num_seqs itself is the last bucket
    assert cg.default_batch_sizes(1) == (1,)
    big = cg.default_batch_sizes(4096)
    assert big[-1] == cg.DEFAULT_MAX_CAPTURE == 512 and 96 in big and 384 in big
    assert list(big) == sorted(set(big))
    # padding is less than one step of rows: gaps grow 8 -> 16 -> 32 -> 64
    gaps = [b - a for a, b in zip(big[4:], big[5:])]
    assert max(gaps) == 64 and gaps == sorted(gaps)


def test_capture_sizes_and_pick_bucket():
    assert cg.capture_sizes(EngineConfig(max_num_seqs=48)) == (1, 2, 4, 8, 16, 24, 32, 48)
    assert cg.capture_sizes(EngineConfig(max_num_seqs=48, cuda_graph_batch_sizes=(2, 8))) == (2, 8)
    sizes = (1, 2, 4, 8, 16, 24)
    assert [cg.pick_bucket(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 24)] == [1, 2, 4, 8, 8, 16, 24, 24]
    assert cg.pick_bucket(sizes, 25) is None
    assert cg.pick_bucket((2, 8), 1) == 2


def test_engine_config_validates_graph_fields_and_loads_strictly():
    assert EngineConfig().enforce_eager is False and EngineConfig().cuda_graph_batch_sizes is None
    cfg = EngineConfig(cuda_graph_batch_sizes=[1, 4])  # a list from Python is stored as the declared tuple
    assert cfg.cuda_graph_batch_sizes == (1, 4) and hash(cfg)
    for bad in ((), (0, 2), (4, 2), (2, 2)):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes: must be a non-empty ascending"):
            EngineConfig(cuda_graph_batch_sizes=bad)
    with pytest.raises(ValueError, match="exceeds max_num_seqs"):
        EngineConfig(max_num_seqs=8, cuda_graph_batch_sizes=(4, 16))
    loaded = from_dict(EngineConfig, {"enforce_eager": True, "cuda_graph_batch_sizes": [1, 2, 8]}, source="x.yaml")
    assert loaded.enforce_eager is True and loaded.cuda_graph_batch_sizes == (1, 2, 8)
    with pytest.raises(ConfigError, match="x.yaml: enforce_eager: expected bool"):
        from_dict(EngineConfig, {"enforce_eager": "yes"}, source="x.yaml")
    with pytest.raises(ConfigError, match=r"cuda_graph_batch_sizes\[1\]: expected int"):
        from_dict(EngineConfig, {"cuda_graph_batch_sizes": [1, "two"]}, source="x.yaml")
    with pytest.raises(ConfigError, match="x.yaml: EngineConfig: cuda_graph_batch_sizes: .*ascending"):
        from_dict(EngineConfig, {"cuda_graph_batch_sizes": [8, 4]}, source="x.yaml")


def test_serve_flag_enforce_eager_reaches_the_engine_config():
    import argparse

    from deploy.config import load_serve_config
    from deploy.serve_cmd import add_arguments, overrides_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "engine" not in overrides_from_args(parser.parse_args([]))  # not given: the config file decides
    over = overrides_from_args(parser.parse_args(["--enforce-eager"]))
    assert over == {"engine": {"enforce_eager": True}}
    assert load_serve_config("configs/serve/cpu-local.yaml", over).engine.enforce_eager is True
    assert load_serve_config("configs/serve/cpu-local.yaml").engine.enforce_eager is False


# ---- eligibility ----------------------------------------------------------------------------------------------

def test_graph_skip_reason_covers_every_layout_rule():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = EngineConfig()

    def why(cfg=on, device=cuda, tp=1, ep=1, dispatch="alltoall"):
        return cg.graph_skip_reason(cfg, device, tp_size=tp, ep_size=ep, moe_dispatch=dispatch)

    assert why() is None
    assert "enforce_eager" in why(EngineConfig(enforce_eager=True))
    assert "not CUDA" in why(device=cpu)
    # the exact-split all-to-all (and the all-reduce dispatch) read split sizes on the host; capacity does not
    assert "ep > 1" in why(tp=2, ep=2) and "ep > 1" in why(ep=2) and "ep > 1" in why(ep=2, dispatch="allreduce")
    assert why(ep=2, dispatch="capacity") is None
    # tp > 1 (NCCL all-reduce in a graph) only behind the flag, off by default
    assert "tp > 1" in why(tp=2) and "tp > 1" in why(tp=2, ep=2, dispatch="capacity")
    assert EngineConfig().cuda_graph_tp is False
    tp_on = EngineConfig(cuda_graph_tp=True)
    assert why(tp_on, tp=2) is None and why(tp_on, tp=2, ep=2, dispatch="capacity") is None
    assert "ep > 1" in why(tp_on, tp=2, ep=2)


def test_plan_dp_step_pads_every_rank_to_one_bucket_or_none():
    sizes = (1, 2, 4, 8)
    # graph steps everywhere: the largest rank's rows pick the bucket, idle ranks (0 rows) join it
    assert cg.plan_dp_step([(3, 3), (1, 1)], sizes) == (4, 4)
    assert cg.plan_dp_step([(0, 0), (5, 5)], sizes) == (8, 8)
    # one rank's step cannot replay (a prefill chunk): every rank eager, buffers sized for the largest step
    assert cg.plan_dp_step([(40, None), (2, 2)], sizes) == (40, None)
    assert cg.plan_dp_step([(2, 2), (0, 0)], None) == (2, None)  # no graphs captured
    assert cg.plan_dp_step([(9, 9), (1, 1)], sizes) == (9, None)  # past the largest bucket
    assert cg.plan_dp_step([(0, 0), (0, 0)], sizes) == (0, None)


def _batch(chunks, *, sample=None, plp=()):
    sample = list(range(len(chunks))) if sample is None else sample
    return StepBatch(input_ids=[5] * sum(c.num_tokens for c in chunks), chunks=chunks, sample_chunks=sample,
                     rows=[], released_seq_ids=[], prompt_logprob_chunks=plp)


def test_is_graph_step_only_for_sampled_decode_rows_within_the_largest_bucket():
    dec = [ChunkSpec([i], 3, 1, True) for i in range(4)]
    assert cg.is_graph_step(_batch(dec), 4)
    assert not cg.is_graph_step(_batch(dec), 3)  # more rows than the largest bucket: eager
    assert not cg.is_graph_step(_batch([]), 4)
    assert not cg.is_graph_step(_batch([ChunkSpec([0], 0, 4, False)] + dec[:2]), 8)  # mixed prefill + decode
    assert not cg.is_graph_step(_batch([ChunkSpec([0], 3, 1, False)]), 8)  # a 1-token prefill chunk
    assert not cg.is_graph_step(_batch(dec, sample=[0, 2]), 8)  # not every row samples
    assert not cg.is_graph_step(_batch([ChunkSpec([0], 3, 1, True, all_logits=True)]), 8)
    assert not cg.is_graph_step(_batch(dec, plp=[object()]), 8)


# ---- packing a step into the static buffers ---------------------------------------------------------------------

PS = 16


def _random_decode_chunks(rng: random.Random, n: int, num_pages: int, max_len: int):
    """n decode rows with shuffled, disjoint page tables; positions straddle page boundaries."""
    pool = list(range(1, num_pages))  # page 0 stays out of every table (padding rows point at it)
    rng.shuffle(pool)
    chunks, ids = [], []
    for _ in range(n):
        start = rng.choice([0, PS - 1, PS, 2 * PS - 1, 2 * PS, rng.randrange(max_len)])
        need = start // PS + 1
        table, pool = pool[:need], pool[need:]
        chunks.append(ChunkSpec(table, start, 1, True))
        ids.append(rng.randrange(3, 384))
    return chunks, ids


@pytest.mark.parametrize("n,bucket", [(1, 1), (3, 4), (5, 8), (8, 8), (13, 16)])
def test_filled_static_buffers_equal_build_metadata_on_real_rows_and_pad_the_rest(n, bucket):
    rng = random.Random(n)
    max_pages = 8
    static = cg.StaticInputs.allocate(16, max_pages, "cpu")
    buf = torch.empty(cg.packed_len(16, max_pages), dtype=torch.int64)
    # a wide step first, so the narrower one below finds stale table columns and stale rows
    wide, wide_ids = _random_decode_chunks(rng, 16, 200, max_pages * PS)
    w = cg.fill_decode_inputs(buf, wide, wide_ids, 16, PS, max_pages)
    cg.load_decode_inputs(static, buf[:cg.packed_len(16, w)], 16, w)

    chunks, ids = _random_decode_chunks(rng, n, 200, 3 * PS)
    width = cg.fill_decode_inputs(buf, chunks, ids, bucket, PS, max_pages)
    assert width == max(len(c.page_table) for c in chunks)
    cg.load_decode_inputs(static, buf[:cg.packed_len(bucket, width)], bucket, width)
    meta = static.metadata(bucket, PS, max_context_len=max_pages * PS)
    want = build_metadata(chunks, PS)
    real = slice(0, n)
    assert static.input_ids(bucket)[real].tolist() == ids
    for name in ("positions", "slot_mapping", "row_seq", "context_lens", "logits_indices"):
        got = getattr(meta, name)
        assert got.dtype == getattr(want, name).dtype, name
        assert torch.equal(got[real], getattr(want, name)), name
    assert torch.equal(meta.query_start_loc[:n + 1], want.query_start_loc)
    assert meta.page_tables.dtype == torch.int32 and meta.page_tables.shape == (bucket, max_pages)
    assert torch.equal(meta.page_tables[real, :width], want.page_tables)
    assert meta.num_prefill_tokens == 0 and meta.max_context_len == max_pages * PS
    # every real row reads table columns below `width` only (its own block and earlier): stale columns are unread
    assert bool((meta.positions[real] // PS < width).all())
    # padded rows: token 0 at position 0, not written, one valid token in page 0, their own request row
    pad = slice(n, bucket)
    assert static.input_ids(bucket)[pad].eq(0).all() and meta.positions[pad].eq(0).all()
    assert meta.slot_mapping[pad].eq(-1).all() and meta.context_lens[pad].eq(1).all()
    assert meta.page_tables[pad, :width].eq(0).all()
    assert meta.row_seq.tolist() == list(range(bucket)) and meta.query_start_loc.tolist() == list(range(bucket + 1))


def test_fill_decode_inputs_pads_a_rank_with_no_rows():
    # an idle lockstep dp rank replays its group's bucket with padding only: page 0, slot -1, context 1
    buf = torch.full((cg.packed_len(4, 3),), 99, dtype=torch.int64)
    assert cg.fill_decode_inputs(buf, [], [], 4, PS, 3) == 1
    ids, pos, slots, ctx_lens, table = buf[:4], buf[4:8], buf[8:12], buf[12:16], buf[16:20]
    assert ids.eq(0).all() and pos.eq(0).all() and slots.eq(-1).all() and ctx_lens.eq(1).all()
    assert table.eq(0).all()


def test_fill_decode_inputs_rejects_what_no_bucket_holds():
    buf = torch.empty(cg.packed_len(4, 2), dtype=torch.int64)
    chunks = [ChunkSpec([1], 0, 1, True)] * 3
    with pytest.raises(ValueError, match="3 rows and 3 ids for a bucket of 2"):
        cg.fill_decode_inputs(buf, chunks, [1, 2, 3], 2, PS, 2)
    with pytest.raises(ValueError, match="3 rows and 2 ids"):
        cg.fill_decode_inputs(buf, chunks, [1, 2], 4, PS, 2)
    with pytest.raises(ValueError, match="page table of 3 pages exceeds the captured width 2"):
        cg.fill_decode_inputs(buf, [ChunkSpec([1, 2, 3], 40, 1, True)], [1], 4, PS, 2)


# ---- the padded step, run eagerly on CPU ------------------------------------------------------------------------

class EagerReplay(cg.DecodeGraphs):
    """DecodeGraphs whose replay runs the captured work eagerly on the static buffers (no graphs on CPU): the
    runner's graph path, minus the graph."""

    def replay(self, bucket: int) -> torch.Tensor:
        return self.forward(bucket)


def _clone(kv: KVCache) -> KVCache:
    return KVCache(k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v],
                   index_k=[None if t is None else t.clone() for t in kv.index_k], num_pages=kv.num_pages,
                   page_size=kv.page_size)


@torch.inference_mode()
def test_padded_step_on_static_buffers_equals_the_eager_step_and_writes_no_padding(tiny_ckpt):
    from msa.model import load_model

    model = load_model(tiny_ckpt)
    ps = model.config.page_size
    kv = KVCache.allocate(model.config, 40)
    rng = random.Random(3)
    pool = list(range(1, 40))  # page 0 in no table: padded rows point at it and must leave it untouched
    rng.shuffle(pool)
    lens = [ps - 1, ps, 2 * ps + 3, 37, 70]  # contexts at and across page boundaries
    tables = []
    for n in lens:  # prefill each request (eager, the reference path on CPU)
        table, pool = pool[:n // ps + 2], pool[n // ps + 2:]
        tables.append(table)
        ids = torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(n))
        model(ids, build_metadata([ChunkSpec(table, 0, n, False)], ps), kv)
    kv_eager = _clone(kv)
    graphs = EagerReplay(model, kv, sizes=(1, 2, 4, 8), max_model_len=512, device="cpu")
    assert graphs.max_pages == 512 // ps
    for step in range(3):  # contexts grow across steps
        chunks = [ChunkSpec(t[:(n + step) // ps + 1], n + step, 1, True) for t, n in zip(tables, lens)]
        ids = [rng.randrange(3, 384) for _ in chunks]
        meta = build_metadata(chunks, ps)
        want = model.compute_logits(model(torch.tensor(ids), meta, kv_eager)[meta.logits_indices])
        got = graphs.run(chunks, ids)  # 5 rows in the bucket of 8
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in range(kv.num_layers):
        assert kv.k[layer][0].eq(0).all() and kv.v[layer][0].eq(0).all()  # slot -1: padding wrote nothing
        # a padded batch of 8 runs other BLAS blockings than 5 rows: a few ulps on some CPUs (2.7e-6 seen here)
        torch.testing.assert_close(kv.k[layer], kv_eager.k[layer], rtol=1e-5, atol=1e-5)


def test_runner_on_cpu_never_captures_and_the_graph_path_samples_like_eager(make_llm, monkeypatch):
    def no_capture(self):
        raise AssertionError("capture attempted on CPU")

    monkeypatch.setattr(cg.DecodeGraphs, "capture", no_capture)
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in (5, 15, 16, 17, 33, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (9, 14, 4, 20, 11, 7)]

    eager = make_llm(num_pages=64, max_num_seqs=8)  # enforce_eager off: on CPU nothing is captured
    runner = eager.engine.executor.runner
    assert runner.graphs is None and runner.info()["cuda_graph_sizes"] == []
    want = eager.generate(prompts, params)
    assert runner.num_graph_steps == 0

    # the runner's graph path with the replay run eagerly: same tokens and logprobs as the eager path, while
    # the batch shrinks (requests finish at different lengths) through buckets 8, 4, 2, 1
    llm = make_llm(num_pages=64, max_num_seqs=8)
    runner = llm.engine.executor.runner
    runner.graphs = EagerReplay(runner.model, runner.kv, sizes=(1, 2, 4, 8), max_model_len=512, device="cpu")
    got = llm.generate(prompts, params)
    assert runner.num_graph_steps >= 19  # every decode step (the longest request decodes 19 tokens)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for dg, dw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert dg.keys() == dw.keys() and max(abs(dg[t] - dw[t]) for t in dg) < 1e-4
