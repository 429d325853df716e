"""Engine decode step with CUDA graphs vs eager: one in-process Engine on one GPU, m3-slice shapes.

Model: configs/models/m3-slice.yaml (full per-layer M3 shapes, 4 layers: 1 dense + 3 sparse/MoE) with fewer
routed experts (default 16, top-4: the weights fit beside a KV pool and write quickly), bf16, random weights drawn
on the GPU by msa.checkpoint.write_checkpoint into /tmp (reused with --ckpt-dir). One Engine (workers/llm.py's
LLM) captures its decode graphs at startup (the capture time is reported). Then for each B in --batches:
B requests of --prompt-len random tokens, greedy, --decode-tokens generated tokens each, run once with the
graphs and once eagerly (the runner's graphs set aside; the same prompts, so the second run's prefill comes
from the prefix cache). Each run is preceded by a 3-token warm-up of the same prompts (Triton compiles, cache).

Reported per B and mode, over the pure-decode steps with B rows:
  step_ms     median engine step (schedule + inputs + forward + sample + update): the TPOT of driving the
              Engine in-process (each such step gives every request one token)
  forward_ms  median forward part of it (inputs to the device, forward + LM head, synchronised)
  replay_ms   graphs only: the bucket's graph replayed alone, CUDA events (the device time of the step)
and the greedy tokens' agreement between the modes (bf16: a near-tie may flip a token; then that request's
continuation differs). Beside them: this model's bytes floor (benchmarks/kernels/bench_moe.py's count at the
mean context) and, with --num-experts 128 only, PERF.md's target.

  PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine_decode.py                  # one H200, ~2-3 min
  PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine_decode.py --tiny --device cpu --batches 1,2
Writes bench_engine_decode.json to --out ($OUT) after every batch size; prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (workers, msa)

RESULT_NAME = "bench_engine_decode.json"
PERF_TARGET_MS = {1: 1.9, 16: 6.3, 64: 12.4}  # PERF.md m3-slice decode targets (128 experts, 1024-token prompts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny preset in fp32 (CPU smoke run: eager only)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=None, help="default 1024 (tiny 40)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens generated per request (default 48; tiny 6)")
    p.add_argument("--max-model-len", type=int, default=4096, help="the graphs' table width comes from it")
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--experts-per-tok", type=int, default=4)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory: written if it holds none, else reused")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT"), help=f"directory for {RESULT_NAME}")
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    a.prompt_len = a.prompt_len or (40 if a.tiny else 1024)
    a.decode_tokens = a.decode_tokens or (6 if a.tiny else 48)
    return a


def _say(msg: str) -> None:
    print(f"[bench_engine_decode] {msg}", flush=True)


# ---- model and engine -------------------------------------------------------------------------------------------

def prepare_model(args) -> tuple[Path, dict]:
    """The checkpoint directory and what it holds: the tiny model, or m3-slice with fewer experts written now."""
    from msa.checkpoint import write_checkpoint
    from workers.models import preset_config, tiny_model_dir

    if args.tiny:
        return tiny_model_dir(), {"preset": "tiny", "dtype": "float32"}
    config = dataclasses.replace(preset_config("m3-slice"), num_local_experts=args.num_experts,
                                 num_experts_per_tok=args.experts_per_tok, torch_dtype="bfloat16")
    info = {"preset": "m3-slice", "num_local_experts": args.num_experts, "num_experts_per_tok": args.experts_per_tok,
            "dtype": "bfloat16"}
    out = Path(args.ckpt_dir or tempfile.mkdtemp(prefix=f"m3-slice-e{args.num_experts}-", dir="/tmp"))
    if not (out / "config.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(config, out, seed=args.seed, dtype=torch.bfloat16, num_shards=4, device=args.device)
        info["write_s"] = time.perf_counter() - t0
    return out, info


def build_llm(args, model_dir: Path):
    from workers.llm import LLM

    page_size = 16 if args.tiny else 128
    per_req = -(-(args.prompt_len + args.decode_tokens + 8) // page_size) + 1
    # both modes' pages (the first run's stay cached for the second) plus slack
    num_pages = 2 * max(args.batches) * per_req + 64
    t0 = time.perf_counter()
    llm = LLM(model_dir, device=args.device, num_pages=num_pages, max_num_seqs=max(max(args.batches), 1),
              max_model_len=args.max_model_len, max_num_batched_tokens=max(2048, args.prompt_len),
              seed=args.seed)
    return llm, time.perf_counter() - t0


# ---- one batch size ---------------------------------------------------------------------------------------------

def run_mode(llm, prompts, args, b: int) -> tuple[dict, list[list[int]]]:
    """Warm-up, then the timed generation; -> (medians over the pure-decode steps with b rows, tokens)."""
    from workers.request import SamplingParams

    eng = llm.engine
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    runner = eng.executor.runner
    graph_steps0 = runner.num_graph_steps
    eng.pop_step_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    steps = [s for s in eng.pop_step_stats() if s.num_prefill_tokens == 0 and s.batch_size == b]
    res = {"decode_steps": len(steps), "graph_steps": runner.num_graph_steps - graph_steps0, "wall_s": wall}
    if steps:
        res["step_ms"] = 1e3 * statistics.median(s.step_time for s in steps)
        res["forward_ms"] = 1e3 * statistics.median(s.step_time - s.host_overhead for s in steps)
        res["tok_per_s"] = b / (res["step_ms"] / 1e3)
    return res, [o.outputs[0].token_ids for o in outs]


def replay_ms(graphs, b: int, replays: int) -> float | None:
    """Median device time of one replay of b's bucket graph (its static inputs hold the last step's rows, whose
    K/V it rewrites with the same values)."""
    if graphs is None or not torch.cuda.is_available():
        return None
    bucket = graphs.bucket(b)
    for _ in range(3):
        graphs.replay(bucket)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def floor_ms(runner, b: int, context: int) -> float:
    """Bytes floor of this model's decode step at b requests of `context` tokens (benchmarks/kernels/bench_moe.py:
    weights read once, experts touched at uniform routing, bf16 KV) at PERF.md's 4.3 TB/s."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
    from bench_moe import HBM, model_floor_bytes

    return model_floor_bytes(runner.model, runner.config, b, context) / HBM * 1e3


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return {"identical_requests": same, "requests": len(a), "mean_matching_prefix": statistics.mean(prefix)}


def bench_batch(llm, args, b: int, vocab: int) -> dict:
    rng = random.Random(args.seed + b)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]} for _ in range(b)]
    runner = llm.engine.executor.runner
    graphs = runner.graphs
    perf = not args.tiny and args.num_experts == 128  # PERF.md's numbers are for the full expert count
    row = {"B": b, "bucket": graphs.bucket(b) if graphs is not None else None,
           "floor_ms": None if args.tiny else floor_ms(runner, b, args.prompt_len + args.decode_tokens // 2),
           "perf_target_ms": PERF_TARGET_MS.get(b) if perf else None}
    tokens = {}
    if graphs is not None:
        row["graphs"], tokens["graphs"] = run_mode(llm, prompts, args, b)
        row["graphs"]["replay_ms"] = replay_ms(graphs, b, args.replays)
    runner.graphs = None  # eager: the same runner, its graphs set aside
    try:
        row["eager"], tokens["eager"] = run_mode(llm, prompts, args, b)
    finally:
        runner.graphs = graphs
    if "graphs" in tokens:
        row["agreement"] = agreement(tokens["graphs"], tokens["eager"])
        if "step_ms" in row["graphs"] and "step_ms" in row["eager"]:
            row["step_speedup"] = row["eager"]["step_ms"] / row["graphs"]["step_ms"]
    return row


# ---- report -----------------------------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(doc: dict) -> str:
    head = (f"engine decode, {doc['model']['preset']} ({doc['model'].get('num_local_experts', '-')} experts), "
            f"prompt {doc['prompt_len']}, {doc['decode_tokens']} tokens, {doc['device_name']}; "
            f"graphs {doc['graph_sizes']} captured in {_f(doc['capture_s'])} s")
    cols = ("B", "eager step ms", "graph step ms", "speedup", "eager fwd ms", "graph fwd ms", "replay ms",
            "floor/target ms", "same reqs")
    lines = [head, " | ".join(cols)]
    for r in doc["rows"]:
        e, g, agree = r.get("eager", {}), r.get("graphs", {}), r.get("agreement")
        cells = (str(r["B"]), _f(e.get("step_ms")), _f(g.get("step_ms")), _f(r.get("step_speedup"), "{:.2f}x"),
                 _f(e.get("forward_ms")), _f(g.get("forward_ms")), _f(g.get("replay_ms")),
                 f"{_f(r['floor_ms'])}/{_f(r['perf_target_ms'])}",
                 f"{agree['identical_requests']}/{agree['requests']}" if agree else "-")
        lines.append(" | ".join(c.rjust(len(h)) for c, h in zip(cells, cols)))
    return "\n".join(lines)


def save(doc: dict, out: str | None) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / RESULT_NAME).write_text(json.dumps(doc, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        _say("no CUDA device (use --device cpu --tiny for the smoke run)")
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)  # the tiny smoke run: intra-op threads only fight over a small machine's cores
    model_dir, model_info = prepare_model(args)
    _say(f"model {model_dir} {model_info}")
    llm, build_s = build_llm(args, model_dir)
    runner = llm.engine.executor.runner
    info = runner.info()
    doc = {"model": model_info, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
           "max_model_len": args.max_model_len, "device_name": torch.cuda.get_device_name() if args.device == "cuda"
           else "cpu", "engine_build_s": build_s, "graph_sizes": info["cuda_graph_sizes"],
           "capture_s": info["cuda_graph_capture_s"],
           "graph_pool_mib": runner.graphs.pool_bytes / 2**20 if runner.graphs is not None else None,
           "num_pages": info["num_pages"], "rows": []}
    _say(f"engine up in {build_s:.1f} s; graphs {doc['graph_sizes']} captured in {_f(doc['capture_s'])} s")
    save(doc, args.out)
    for b in args.batches:
        row = bench_batch(llm, args, b, runner.config.vocab_size)
        _say(json.dumps(row))
        doc["rows"].append(row)
        save(doc, args.out)
    llm.engine.shutdown()
    print(format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
