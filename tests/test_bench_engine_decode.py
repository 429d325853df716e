"""CPU smoke run of benchmarks/bench_engine_decode.py: the tiny model in one in-process engine, eager only (CPU has
no graphs), the JSON it writes and the table it prints last. The graph rows are exercised on the GPU run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_engine_decode.py"


def test_tiny_cpu_run_writes_json_and_prints_the_table_last(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--batches", "1,2",
                           "--decode-tokens", "4", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "bench_engine_decode.json").read_text())
    assert doc["graph_sizes"] == [] and doc["capture_s"] is None  # CPU: every step eager
    assert [r["B"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        eager = r["eager"]
        assert "graphs" not in r and eager["graph_steps"] == 0
        assert eager["decode_steps"] == 3 and eager["step_ms"] >= eager["forward_ms"] > 0  # 4 tokens: 3 decode steps
    # the routed floor counts the experts each decode step touched: one row picks exactly top-k distinct
    # experts per layer, two rows between k and 2k; the floor moves with them
    from workers.models import preset_config

    cfg = preset_config("tiny")
    k = cfg.num_experts_per_tok
    one, two = (r["routing"] for r in doc["rows"])
    assert one["steps"] == two["steps"] == 3
    assert one["mean_touched_per_layer"] == one["max_touched_per_layer"] == k
    assert k <= two["mean_touched_per_layer"] <= min(2 * k, cfg.num_local_experts)
    assert 0 < doc["rows"][0]["floor_ms"] < doc["rows"][1]["floor_ms"]
    table = proc.stdout.strip().splitlines()
    assert table[-4].startswith("engine decode, tiny") and table[-3].startswith("B | eager step ms")
    assert [line.split("|")[0].strip() for line in table[-2:]] == ["1", "2"]


def test_the_transformers_reference_harness_decodes_the_engines_tokens(tmp_path):
    """benchmarks/hf_reference.py (bench_engine_decode.py --hf-reference): on the tiny model in fp32, transformers'
    batched greedy decode with its KV cache, run in a process of its own, gives the engine's greedy tokens for the
    same prompts from the same transformers-layout checkpoint, and a step time per token."""
    import random

    sys.path.insert(0, str(REPO / "benchmarks"))
    import hf_reference

    from workers.llm import LLM
    from workers.models import TINY_PRESET, write_preset_checkpoint
    from workers.request import SamplingParams

    ckpt = write_preset_checkpoint(TINY_PRESET, tmp_path / "tiny", seed=0, layout="transformers")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(30)] for _ in range(3)]
    # in its own process, as bench_engine_decode.py runs it (two batch sizes, one model load)
    rows = hf_reference.run_in_subprocess(ckpt, {3: prompts, 1: prompts[:1]}, 6, device="cpu", dtype="float32",
                                          timeout_s=300)
    res = rows[3]
    assert res["attn_implementation"] in ("sdpa", "eager") and res["steps"] == 5 and res["step_ms"] > 0
    outs = LLM(ckpt, num_pages=32).generate([{"prompt_token_ids": p} for p in prompts],
                                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert res["tokens"] == [o.outputs[0].token_ids for o in outs]
    assert rows[1]["tokens"] == res["tokens"][:1]
