"""Fused MoE kernels vs the torch loop: CPU through the Triton interpreter (fp32/fp16, tiny shapes) and, with a
GPU, bf16 at the real M3 shapes (H 6144, I 3072 per expert, 128 experts, top-4), CUDA-graph capture included.

TRITON_INTERPRET=1 is set by tests/conftest.py (and this folder's conftest) before triton is first imported.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import fused_moe as fm  # noqa: E402

ALPHA, LIMIT = 1.702, 7.0
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA machine: Triton compiles for the GPU here")
# small tiles so the tiny shapes still take several blocks per expert, several column tiles and a K loop
TINY = fm.MoEConfig(block_m=16, gate_up=fm.GemmTile(block_n=16, block_k=16), down=fm.GemmTile(block_n=16, block_k=16))
# the grouped program order (prefill): groups of 3 row blocks, so the last group is partial
TINY_GROUPED = fm.MoEConfig(block_m=16, gate_up=fm.GemmTile(block_n=16, block_k=16, group_m=3),
                            down=fm.GemmTile(block_n=16, block_k=16, group_m=2))
# the prefill variants: weight tiles through TMA descriptors (K tails read zero past H and I) and half-height tiles
# for an expert's last block (32-row blocks: experts with <= 16 rows take the 16-row tile)
TINY_TMA_TAIL = fm.MoEConfig(block_m=32,
                             gate_up=fm.GemmTile(block_n=16, block_k=32, group_m=2, tma=True, half_tail=True),
                             down=fm.GemmTile(block_n=16, block_k=16, tma=True, half_tail=True))


def _routing(t: int, k: int, num_ids: int, gen: torch.Generator, *, skew: int | None = None,
             allowed: list[int] | None = None) -> torch.Tensor:
    """[t, k] int64, distinct ids per token from `allowed` (default all); skew: every token's slot 0 is this id."""
    pool = torch.tensor(allowed if allowed is not None else list(range(num_ids)))
    rows = []
    for _ in range(t):
        pick = pool[torch.randperm(len(pool), generator=gen)]
        if skew is not None:
            pick = torch.cat([torch.tensor([skew]), pick[pick != skew]])
        rows.append(pick[:k])
    return torch.stack(rows).to(torch.int64)


def _weights(e: int, h: int, i: int, dtype, gen, device="cpu", scale: float = 0.25):
    w_gu = (torch.randn(e, 2 * i, h, generator=gen) * scale).to(device=device, dtype=dtype)
    w_d = (torch.randn(e, h, i, generator=gen) * scale).to(device=device, dtype=dtype)
    return w_gu, w_d


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.fixture
def poisoned_workspace(monkeypatch, nan_poison):
    """Every workspace buffer the launcher allocates starts as NaN (ints as a huge negative): a kernel that reads
    a row or count it never wrote fails the comparison."""
    poison_, _ = nan_poison
    real = fm._empty

    def empty(shape, dtype, device):
        return poison_(real(shape, dtype, device))

    monkeypatch.setattr(fm, "_empty", empty)


# ---------------------------------------------------------------- CPU (interpreter)

@on_cpu
@pytest.mark.parametrize("parallel", [False, True], ids=["one-program", "parallel"])
def test_align_sorts_pairs_by_expert_stably_with_empty_single_and_foreign_experts(poisoned_workspace, parallel,
                                                                                   monkeypatch):
    if parallel:  # the prefill-size path, on 4 chunks of 16 pairs
        monkeypatch.setattr(fm, "PARALLEL_ALIGN_PAIRS", 0)
        monkeypatch.setattr(fm, "ALIGN_CHUNK_MIN", 16)
    gen = torch.Generator().manual_seed(0)
    # ids 0..9, local experts 2..7 (6): expert 2 gets 18 pairs (two 16-row blocks), 3 none, 4 exactly one,
    # ids 0, 1, 8, 9 belong to other ranks
    ids = _routing(18, 3, 10, gen, skew=2, allowed=[0, 1, 2, 5, 6, 7, 8, 9])
    ids[7, 2] = 4  # not in `allowed`: the only pair of local expert 2
    align = fm.moe_align(ids, 6, 16, expert_start=2)
    flat = ids.reshape(-1) - 2
    want_counts = torch.bincount(flat[(flat >= 0) & (flat < 6)], minlength=6)
    assert want_counts[0] == 18 and want_counts[1] == 0 and want_counts[2] == 1
    assert torch.equal(align.counts.long(), want_counts)
    assert torch.equal(align.row_start.long(), torch.cumsum(want_counts, 0) - want_counts)
    assert torch.equal(align.block_end.long(), torch.cumsum((want_counts + 15) // 16, 0))
    n = int(want_counts.sum())
    local = torch.where((flat >= 0) & (flat < 6), flat, 6)
    want_order = torch.argsort(local, stable=True)[:n]
    assert torch.equal(align.sorted_pairs[:n].long(), want_order)
    # the poisoned tail stays untouched: exactly the local pairs were written
    assert (align.sorted_pairs[n:] == -(2**30)).all() and n < ids.numel()


@on_cpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("case", ["one_token", "uneven", "foreign_experts", "tokens_without_local_experts"])
@pytest.mark.parametrize("config", [TINY, TINY_GROUPED, TINY_TMA_TAIL], ids=["m-fastest", "grouped", "tma-half-tail"])
def test_fused_moe_matches_ref(case, dtype, tol, config, nan_poison, poisoned_workspace):
    poison_, assert_all_written = nan_poison
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    h, i = 48, 24  # not powers of two: masked K tail and a partial column tile
    if case == "one_token":  # one token, every expert it picks has exactly one pair; the rest none
        e, start, ids = 8, 0, _routing(1, 3, 8, gen)
    elif case == "uneven":  # expert 5 takes every token (two blocks), some experts get none
        e, start, ids = 8, 0, _routing(21, 2, 8, gen, skew=5, allowed=[0, 2, 5, 7])
    elif case == "foreign_experts":  # ep-style: local experts 4..9 of 12, pairs of ranks' others skipped
        e, start, ids = 6, 4, _routing(13, 4, 12, gen, skew=6)
    else:  # some tokens have no local expert at all: their output row must be an exact zero
        e, start, ids = 4, 4, _routing(9, 2, 12, gen)
        ids[[1, 4]] = torch.tensor([0, 11])
    t = ids.shape[0]
    x = torch.randn(t, h, generator=gen).to(dtype)
    weights = torch.rand(t, ids.shape[1], generator=gen) + 0.1
    w_gu, w_d = _weights(e, h, i, dtype, gen)
    out = poison_(torch.empty(t, h, dtype=dtype))
    got = fm.fused_moe(x, ids, weights, w_gu, w_d, alpha=ALPHA, limit=LIMIT, expert_start=start, config=config,
                       out=out, backend="triton")
    assert got.data_ptr() == out.data_ptr()
    assert_all_written(out)
    want = fm.fused_moe_ref(x.float(), ids, weights, w_gu.float(), w_d.float(), alpha=ALPHA, limit=LIMIT,
                            expert_start=start)
    assert _rel(got, want) <= tol, _rel(got, want)
    local = ((ids >= start) & (ids < start + e)).any(1)
    assert (got[~local] == 0).all()
    assert (got[local].abs().sum(1) > 0).all()


@on_cpu
def test_gate_clamp_is_upper_only_and_up_clamp_both_sides():
    # one expert, identity-like weights: gate = x[0] and up = x[1] exactly, so the activation is readable
    h, i = 16, 16
    w_gu = torch.zeros(1, 2 * i, h)
    w_gu[0, 0, 0] = 1.0  # gate column 0 reads x[:, 0]
    w_gu[0, i, 1] = 1.0  # up column 0 reads x[:, 1]
    w_d = torch.zeros(1, h, i)
    w_d[0, 0, 0] = 1.0  # output column 0 = activation column 0
    x = torch.zeros(5, h)
    x[:, 0] = torch.tensor([-30.0, -2.0, 0.5, 9.0, 30.0])  # gate: very negative stays (no lower clamp)
    x[:, 1] = torch.tensor([-20.0, 3.0, -0.5, 20.0, 1.0])  # up: clamped to [-7, 7]
    ids = torch.zeros(5, 1, dtype=torch.int64)
    w = torch.ones(5, 1)
    got = fm.fused_moe(x, ids, w, w_gu, w_d, alpha=ALPHA, limit=LIMIT, config=TINY, backend="triton")[:, 0]
    g = x[:, 0].clamp(max=LIMIT)
    u = x[:, 1].clamp(-LIMIT, LIMIT)
    want = (u + 1) * g * torch.sigmoid(ALPHA * g)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got[0] != 0  # gate -30 was not clamped up to -7 (that would give a different value)
    assert not torch.isclose(got[0], (u[0] + 1) * -LIMIT * torch.sigmoid(torch.tensor(-ALPHA * LIMIT)))


@on_cpu
def test_rows_interface_and_empty_batch():
    # the EP receive path: k = 1, weight 1, local ids -> each row's unweighted expert output, in order
    gen = torch.Generator().manual_seed(7)
    e, h, i = 3, 32, 16
    w_gu, w_d = _weights(e, h, i, torch.float32, gen)
    rows = torch.randn(10, h, generator=gen)
    local = torch.tensor([2, 0, 0, 1, 2, 2, 0, 1, 1, 2])
    got = fm.fused_moe(rows, local[:, None], torch.ones(10, 1), w_gu, w_d, alpha=ALPHA, limit=LIMIT, config=TINY,
                       backend="triton")
    for r in range(10):
        act = fm.swiglu_oai_ref(rows[r] @ w_gu[local[r]].T, ALPHA, LIMIT)
        assert torch.allclose(got[r], act @ w_d[local[r]].T, rtol=1e-4, atol=1e-5)
    empty = fm.fused_moe(rows[:0], local[:0, None], torch.ones(0, 1), w_gu, w_d, alpha=ALPHA, limit=LIMIT,
                         backend="triton")
    assert empty.shape == (0, h)


@on_cpu
def test_default_config_runs_and_bound_holds():
    gen = torch.Generator().manual_seed(3)
    e, h, i = 8, 64, 32
    w_gu, w_d = _weights(e, h, i, torch.float16, gen)
    ids = _routing(6, 2, e, gen)
    x = torch.randn(6, h, generator=gen).half()
    w = torch.rand(6, 2, generator=gen)
    got = fm.fused_moe(x, ids, w, w_gu, w_d, alpha=ALPHA, limit=LIMIT, backend="triton")
    want = fm.fused_moe_ref(x.float(), ids, w, w_gu.float(), w_d.float(), alpha=ALPHA, limit=LIMIT)
    assert _rel(got, want) < 2e-3
    # the grid bound covers the worst routing: every expert one pair short of a block boundary
    for n, experts, bm in ((1, 128, 16), (4, 128, 16), (1024, 128, 16), (40, 3, 16), (64, 64, 32)):
        worst = sum(-(-c // bm) for c in _worst_counts(n, experts, bm))
        assert worst <= fm.max_blocks(n, experts, bm)


def _worst_counts(n: int, experts: int, bm: int) -> list[int]:
    # as many experts as possible with one pair (each a whole block), the rest on one expert
    ones = min(n, experts) - 1
    return [1] * ones + [n - ones]


@on_cpu
def test_checks_name_the_bad_argument():
    x = torch.randn(2, 16)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    w = torch.ones(2, 1)
    w_gu, w_d = torch.randn(2, 32, 16), torch.randn(2, 16, 16)
    with pytest.raises(ValueError, match="w_down"):
        fm.fused_moe(x, ids, w, w_gu, torch.randn(2, 16, 8), alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="topk_weights"):
        fm.fused_moe(x, ids, torch.ones(2, 2), w_gu, w_d, alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="dtype"):
        fm.fused_moe(x, ids, w, w_gu.half(), w_d, alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="unit stride"):
        fm.fused_moe(x, ids, w, w_gu.transpose(1, 2).contiguous().transpose(1, 2), w_d, alpha=ALPHA, limit=LIMIT,
                     backend="triton")


@on_cpu
def test_msa_experts_triton_backend_equals_the_loop():
    # the model's Experts module through the interpreter vs its CPU (reference) path, tiny config, tp split
    from msa.config import M3Config
    from msa.moe import Experts
    from msa.parallel import ParallelContext
    from workers.configio import load_yaml, preset_path

    cfg = load_yaml(preset_path("models", "tiny"), M3Config)
    torch.manual_seed(0)
    experts = Experts(cfg, ParallelContext.single(), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(5, cfg.hidden_size, generator=gen)
        ids = _routing(5, cfg.num_experts_per_tok, cfg.num_local_experts, gen)
        w = torch.rand(5, cfg.num_experts_per_tok, generator=gen)
        want = experts(x, ids, w)
        experts.backend, experts.config = "triton", TINY
        got = experts(x, ids, w)
        rows = experts.forward_rows(x, ids[:, 0])
        experts.backend = None
        rows_ref = experts.forward_rows(x, ids[:, 0])
    assert _rel(got, want) < 1e-5
    assert _rel(rows, rows_ref) < 1e-5


# ---------------------------------------------------------------- GPU, real shapes

H, I, E, K = 6144, 3072, 128, 4


@pytest.fixture(scope="module")
def real_weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_gu = (torch.randn(E, 2 * I, H, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02)
    w_d = (torch.randn(E, H, I, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02)
    return w_gu, w_d


def _gpu_routing(t: int, gen: torch.Generator, *, experts: int = E, skew: bool = False) -> torch.Tensor:
    scores = torch.rand(t, experts, generator=gen, device="cuda")
    if skew:  # every token picks experts 0..3 first: 4 experts with t pairs each (many blocks per expert)
        scores[:, :4] += 2.0
    return torch.topk(scores, K, dim=-1).indices


@pytest.mark.gpu
@pytest.mark.parametrize("t,skew,start,local", [(1, False, 0, E), (16, False, 0, E), (256, False, 0, E),
                                                 (64, True, 0, E), (200, False, 64, 64), (2048, False, 0, E),
                                                 (4096, False, 0, E), (4096, False, 64, 64), (8192, True, 0, E)])
def test_fused_moe_gpu_real_shapes(real_weights, nan_poison, t, skew, start, local):
    poison_, assert_all_written = nan_poison
    w_gu, w_d = real_weights
    w_gu, w_d = w_gu[start:start + local], w_d[start:start + local]
    gen = torch.Generator(device="cuda").manual_seed(t)
    ids = _gpu_routing(t, gen, skew=skew)
    weights = torch.rand(t, K, generator=gen, device="cuda") + 0.1
    x = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
    out = poison_(torch.empty(t, H, device="cuda", dtype=torch.bfloat16))
    fm.fused_moe(x, ids, weights, w_gu, w_d, alpha=ALPHA, limit=LIMIT, expert_start=start, out=out)
    assert_all_written(out)
    truth = fm.fused_moe_ref(x, ids, weights, w_gu, w_d, alpha=ALPHA, limit=LIMIT, expert_start=start,
                             acc_dtype=torch.float32)
    loop = fm.fused_moe_ref(x, ids, weights, w_gu, w_d, alpha=ALPHA, limit=LIMIT, expert_start=start)
    err, loop_err = _rel(out, truth), _rel(loop, truth)
    print(f"t={t} skew={skew} start={start}: fused rel err {err:.2e}, bf16 loop {loop_err:.2e}")
    assert err <= 1e-2 and err <= 1.5 * loop_err + 1e-3


@pytest.mark.gpu
def test_fused_moe_gpu_no_host_sync_and_graph_replay(real_weights):
    w_gu, w_d = real_weights
    t = 16
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(t, H, generator=gen, device="cuda").bfloat16()
    ids = _gpu_routing(t, gen)
    weights = torch.rand(t, K, generator=gen, device="cuda")
    run = lambda: fm.fused_moe(x, ids, weights, w_gu, w_d, alpha=ALPHA, limit=LIMIT)  # noqa: E731
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    # new routing and inputs in place: the replay follows them (nothing about the routing was baked in)
    ids.copy_(_gpu_routing(t, gen, skew=True))
    x.copy_(torch.randn(t, H, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager = run()
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_sparse_moe_cuda_fused_equals_loop_tiny():
    from msa.config import M3Config
    from msa.moe import SparseMoE
    from msa.parallel import ParallelContext
    from workers.configio import load_yaml, preset_path

    cfg = load_yaml(preset_path("models", "tiny"), M3Config)
    torch.manual_seed(0)
    moe = SparseMoE(cfg, ParallelContext.single(), dtype=torch.float32, device="cuda")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(37, cfg.hidden_size, device="cuda")
        fused = moe(x)
        moe.experts.backend = "ref"
        loop = moe(x)
    assert _rel(fused, loop) < 1e-5


# ---------------------------------------------------------------- the benchmark's CPU path

@on_cpu
def test_bench_moe_cpu_smoke(tmp_path):
    # tiny model, the fused kernel through the interpreter inside the model: the plumbing the GPU run relies on
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--device", "cpu", "--tiny", "--batches", "3", "--model-batches", "2", "--context", "40",
                     "--phases", "layer,model", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "bench_moe.json").read_text())
    layer, step = res["layer"][0], res["model"][0]
    assert layer["B"] == 3 and 2 <= layer["touched_experts"] <= 6 and layer["fused_vs_fp32_rel"] < 1e-5
    assert step["B"] == 2 and step["fused_vs_loop_logits_rel"] < 1e-5 and step["argmax_agreement"] == 1.0
    assert step["floor_ms"] > 0 and step["loop_eager_ms"] > 0
