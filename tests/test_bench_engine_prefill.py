"""benchmarks/bench_engine_prefill.py: the CPU smoke run (tiny preset, fp32, random weights drawn at engine start,
the Engine in-process), the JSON it writes and the table it prints last; and its floor arithmetic
(benchmarks/prefill_floor.py) against counts made here by hand from the tiny config's fields (not by the
module's own functions)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_engine_prefill.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine_prefill_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("prefill_floor_under_test", REPO / "benchmarks" / "prefill_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny():
    from workers.models import preset_config

    return preset_config("tiny")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_tiny_cpu_run_writes_json_and_prints_the_table_last(tmp_path):
    proc = _run(tmp_path, "--lengths", "40,100", "--chunk", "64", "--repeats", "2", "--tput-prompts", "3",
                "--tput-len", "40", "--profile", "40")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "bench_engine_prefill.json").read_text())
    assert doc["model"]["preset"] == "tiny" and doc["model"]["dtype"] == "float32" and doc["chunk"] == 64
    assert doc["attention_backend"] == "auto" and doc["max_model_len"] == 101 and doc["num_pages"] > 0
    # the parameter count from the config equals the built model's own parameters
    check = doc["model"]["param_check"]
    assert check["config_per_token"] == check["model"]["per_token"] == 687104
    assert check["config"]["routed_all"] == check["model"]["routed_all"]
    assert check["config"]["lm_head"] == check["model"]["lm_head"]

    rows = {r["length"]: r for r in doc["ttft"]}
    assert set(rows) == {40, 100}
    for n, r in rows.items():
        assert "error" not in r, r
        assert r["repeats"] == 2 and len(r["ttft_ms"]) == 2 and r["ttft_ms_median"] > 0 and r["warmup_ms"] > 0
        assert r["forward_ms"] > 0 and r["floor"]["floor_ms"] > 0
        fl = r["floor"]
        assert max(fl["flop_ms"], fl["byte_ms"]) <= fl["floor_ms"] * (1 + 1e-12) <= fl["flop_ms"] + fl["byte_ms"]
        assert r["floor_over_ttft"] == pytest.approx(r["floor"]["floor_ms"] / r["ttft_ms_median"])
        # what the scheduler ran is what the plan says, so the planned floor is the measured run's floor
        for k in ("floor_ms", "flop_ms", "byte_ms", "steps"):
            assert fl[k] == pytest.approx(r["planned_floor"][k])
    assert rows[40]["chunks"] == [[40]] and rows[40]["num_steps"] == 1
    assert rows[100]["chunks"] == [[64], [36]] and rows[100]["num_steps"] == 2

    t = doc["throughput"]
    assert t["prompts"] == 3 and t["prompt_len"] == 40 and "error" not in t
    assert sum(t["tokens_per_step"]) == 120 and max(t["tokens_per_step"]) <= 64
    assert t["tok_per_s"] == pytest.approx(120 / (t["wall_ms_median"] / 1e3))
    assert t["flop_fraction"] == pytest.approx(t["floor"]["flop_ms"] / t["wall_ms_median"])
    assert t["floor"]["tflop"]["lm_head"] == pytest.approx(3 * 2 * 384 * 128 / 1e12)  # one logits row per prompt

    prof = doc["profile"]
    assert prof["length"] == 40 and prof["top"] and prof["top"][0]["self_ms"] > 0
    assert (tmp_path / "bench_engine_prefill_profile.txt").read_text().startswith("profile: one 40-token prompt")

    table = proc.stdout.strip().splitlines()
    assert table[-5].startswith("engine prefill, tiny") and table[-4].startswith("length | chunk | TTFT ms")
    assert [line.split("|")[0].strip() for line in table[-3:-1]] == ["40", "100"]
    assert table[-1].startswith("3 x 40 prompts, chunk 64:") and "of the FLOP ceiling" in table[-1]


def test_budget_skips_what_would_start_past_it(tmp_path):
    proc = _run(tmp_path, "--lengths", "40", "--budget-s", "0", "--tput-prompts", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_engine_prefill.json").read_text())
    assert doc["ttft"][0]["skipped"] == "budget" and doc["ttft"][0]["planned_floor"]["floor_ms"] > 0
    assert doc["throughput"]["skipped"] == "budget"
    assert "skipped" in proc.stdout.strip().splitlines()[-2]


def _tiny_matrices(c) -> tuple[int, int, int]:
    """(parameters one token multiplies by, routed-expert parameters in all, lm_head parameters), listed matrix by
    matrix from the config as the checkpoint stores them."""
    h, d = c.hidden_size, c.head_dim
    per_token, routed_all = 0, 0
    for i in range(c.num_hidden_layers):
        mats = [(c.num_attention_heads * d, h), (c.num_key_value_heads * d, h), (c.num_key_value_heads * d, h),
                (h, c.num_attention_heads * d)]  # q, k, v, o
        if c.layer_types[i] == "minimax_m3_sparse":
            mats += [(c.index_n_heads * c.index_head_dim, h), (c.index_head_dim, h)]  # index q, index k
        if c.mlp_layer_types[i] == "sparse":
            expert = [(c.intermediate_size, h), (c.intermediate_size, h), (h, c.intermediate_size)]  # w1 w3 w2
            shared = [(c.shared_intermediate_size, h), (c.shared_intermediate_size, h),
                      (h, c.shared_intermediate_size)]
            mats += [(c.num_local_experts, h)] + expert * c.num_experts_per_tok + shared  # router, top-k, shared
            routed_all += c.num_local_experts * sum(a * b for a, b in expert)
        else:
            mats += [(c.dense_intermediate_size, h), (c.dense_intermediate_size, h), (h, c.dense_intermediate_size)]
        per_token += sum(a * b for a, b in mats)
    return per_token, routed_all, c.vocab_size * h


def test_parameter_count_by_hand(floor, tiny):
    per_token, routed_all, lm_head = _tiny_matrices(tiny)
    # tiny: attention 4 x (2*8*32*128 + 2*2*32*128) = 327,680; index 3 x (2*32 + 32)*128 = 36,864; dense MLP
    # 3*256*128 = 98,304; per MoE layer: router 8*128 + top-2 experts 2*3*64*128 + shared 3*64*128 = 74,752, x 3
    assert per_token == 327680 + 36864 + 98304 + 3 * 74752 == 687104
    assert floor.params_per_token(tiny) == per_token
    parts = floor.active_params(tiny)
    assert parts["routed_all"] == routed_all == 3 * 8 * 3 * 64 * 128 and parts["lm_head"] == lm_head == 384 * 128


def test_floor_of_a_chunked_prompt_by_hand(floor, tiny):
    """100 tokens in chunks of 64: (start 0, 64 tokens, no logits) then (start 64, 36 tokens, one logits row)."""
    steps = floor.planned_steps(100, 64)
    assert steps == [[(0, 64, False)], [(64, 36, True)]]
    per_token, routed_all, lm_head = _tiny_matrices(tiny)
    hd = tiny.num_attention_heads * tiny.head_dim  # 256
    span = tiny.index_topk_blocks * tiny.index_block_size  # 64 keys per sparse query at most
    idx = tiny.index_n_heads * tiny.index_head_dim  # 64

    def flops(start, n, logits):
        mean_keys = start + n / 2
        return (2 * per_token * n + (2 * lm_head if logits else 0)
                + 1 * 4 * n * hd * mean_keys  # the one dense-attention layer, causal
                + 3 * 4 * n * hd * min(start + n, span)  # three sparse layers
                + 3 * 2 * n * idx * mean_keys)  # their indexer scores

    f1, f2 = flops(0, 64, False), flops(64, 36, True)
    assert f1 == 2 * 687104 * 64 + 4 * 64 * 256 * 32 + 3 * 4 * 64 * 256 * 64 + 3 * 2 * 64 * 64 * 32

    def nbytes(n, logits):  # fp32 weights: every non-expert matrix, the touched experts, the gathered embeddings
        routed_active_per_token = 3 * 2 * 3 * 64 * 128
        dense_weights = per_token - routed_active_per_token  # includes the routers (fp32 anyway)
        touched = 8 * (1 - (1 - 2 / 8) ** n)  # expected experts of 8 hit by n tokens choosing 2
        return (4 * dense_weights + 4 * 3 * 8  # + the routers' score biases
                + (4 * lm_head if logits else 0) + 4 * n * 128
                + 3 * touched * 3 * 64 * 128 * 4)

    b1, b2 = nbytes(64, False), nbytes(36, True)
    got = floor.floor_of_steps(tiny, steps, dtype_bytes=4)
    assert got["steps"] == 2
    assert got["flop_ms"] == pytest.approx((f1 + f2) / 790e12 * 1e3, rel=1e-12)
    assert got["byte_ms"] == pytest.approx((b1 + b2) / 4.3e12 * 1e3, rel=1e-12)
    want_floor = max(f1 / 790e12, b1 / 4.3e12) + max(f2 / 790e12, b2 / 4.3e12)
    assert got["floor_ms"] == pytest.approx(want_floor * 1e3, rel=1e-12)


def test_m3_slice_floors_match_perf_md(floor):
    """PERF.md: ~1.52 B active parameters per token, ~36 ms (8k) and ~160 ms (32k) of FLOP floor; the weights a
    many-token step reads: 14.5 GB of routed experts per MoE layer."""
    from workers.models import preset_config

    c = preset_config("m3-slice")
    assert floor.params_per_token(c) == pytest.approx(1.52e9, rel=0.005)
    assert floor.floor_of_steps(c, floor.planned_steps(8192, 2048), 2)["flop_ms"] == pytest.approx(36, rel=0.05)
    assert floor.floor_of_steps(c, floor.planned_steps(32768, 2048), 2)["flop_ms"] == pytest.approx(160, rel=0.05)
    experts = floor.step_bytes(c, 8192, 0, 2)["routed_experts"]
    assert experts / 3 == pytest.approx(128 * 3 * 3072 * 6144 * 2, rel=1e-6) == pytest.approx(14.5e9, rel=0.01)


def test_an_out_of_memory_length_is_reported_and_the_next_one_runs(bench, tmp_path, monkeypatch):
    """A step that raises CUDA OOM (simulated: any step of more than 50 tokens) fails only its length: the
    engine's requests are aborted and the following length is measured."""
    import torch

    from workers.runner import ModelRunner

    execute = ModelRunner.execute

    def failing(self, batch):
        if sum(c.num_tokens for c in batch.chunks) > 50:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.00 GiB (simulated)")
        return execute(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", failing)
    assert bench.main(["--device", "cpu", "--tiny", "--lengths", "100,40", "--repeats", "1", "--tput-prompts", "0",
                       "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_engine_prefill.json").read_text())
    oom, ok = doc["ttft"]
    # the engine either raises out of step() or fails the step's requests with the error: reported either way
    assert oom["length"] == 100 and "CUDA OOM: " in oom["error"] and "ttft_ms" not in oom
    assert ok["length"] == 40 and "error" not in ok and ok["repeats"] == 1 and ok["ttft_ms_median"] > 0
    assert doc["throughput"] is None
