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
  forward_ms  median forward part of it (inputs to the device, forward + LM head, synchronised; with
              --async-scheduling the engine thread's time in the executor's launch and result calls)
  host_ms     median host part (StepStats.host_overhead): schedule, batch, update, outputs; with
              --async-scheduling it overlaps the device's work on a GPU (not on the CPU: the launch runs the
              forward there)
  replay_ms   graphs only: the bucket's graph replayed alone, CUDA events (the device time of the step)
and the greedy tokens' agreement between the modes (bf16: a near-tie may flip a token; then that request's
continuation differs). Beside them, two bytes floors at PERF.md's 4.3 TB/s:
  floor_ms        "routed": what each step actually reads. A third, untimed eager pass of the same requests
                  counts on the device, per MoE layer and per decode step, the distinct experts the step's routing
                  touched (a forward hook on every Router; no host sync until the pass ends); the floor is every
                  non-expert weight + the touched experts' weights + the KV the kernels read at that step's
                  context, averaged over the steps. Random weights route unevenly, so this is the honest one.
  uniform_floor_ms  the expected touched experts at uniform routing (benchmarks/kernels/bench_moe.py), as before.
and, with --num-experts 128 only, PERF.md's target. `--hf-reference`: transformers' decode step on the same weights
and prompts (benchmarks/hf_reference.py, in its own process before the engine starts; the checkpoint is then
written in the transformers layout, which the engine reads too), and its tokens' agreement with the graph run's. `--profile B`: a
torch-profiler table of one eager B-row decode step's kernels (device time by kernel name) and the graph replay's,
written to profile_B<b>.txt under --out.

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

ASYNC = {"auto": None, "on": True, "off": False}  # --async-scheduling -> EngineConfig
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
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="EngineConfig.async_scheduling: step n+1 scheduled and launched while step n runs "
                        "(auto: the engine's default, on for CUDA)")
    p.add_argument("--hf-reference", action="store_true",
                   help="also time transformers' decode step on the same weights and prompts (benchmarks/"
                        "hf_reference.py; the checkpoint is written in the transformers layout, read by both)")
    p.add_argument("--profile", default="", help="batch sizes to profile (eager step and graph replay kernels)")
    p.add_argument("--out", default=os.environ.get("OUT"), help=f"directory for {RESULT_NAME}")
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    a.profile = [int(b) for b in a.profile.split(",") if b]
    a.prompt_len = a.prompt_len or (40 if a.tiny else 1024)
    a.decode_tokens = a.decode_tokens or (6 if a.tiny else 48)
    return a


def _say(msg: str) -> None:
    print(f"[bench_engine_decode] {msg}", flush=True)


# ---- model and engine -------------------------------------------------------------------------------------------

def slice_config(args):
    """m3-slice with this run's expert count, bf16."""
    from workers.models import preset_config

    return dataclasses.replace(preset_config("m3-slice"), num_local_experts=args.num_experts,
                               num_experts_per_tok=args.experts_per_tok, torch_dtype="bfloat16")


def prepare_model(args) -> tuple[Path, dict]:
    """The checkpoint directory and what it holds: the tiny model, or m3-slice with fewer experts written now."""
    from msa.checkpoint import write_checkpoint
    from workers.models import tiny_model_dir

    if args.tiny:
        return tiny_model_dir(), {"preset": "tiny", "dtype": "float32"}
    config = slice_config(args)
    info = {"preset": "m3-slice", "num_local_experts": args.num_experts, "num_experts_per_tok": args.experts_per_tok,
            "dtype": "bfloat16"}
    out = Path(args.ckpt_dir or tempfile.mkdtemp(prefix=f"m3-slice-e{args.num_experts}-", dir="/tmp"))
    # --hf-reference: the transformers layout, which transformers and the engine both read (one file, one weights)
    layout = "transformers" if args.hf_reference else "hub"
    if args.hf_reference and args.ckpt_dir:
        out = Path(f"{args.ckpt_dir}-transformers")
    if not (out / "config.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(config, out, seed=args.seed, dtype=torch.bfloat16, num_shards=4, device=args.device,
                         layout=layout)
        info["write_s"] = time.perf_counter() - t0
    info["layout"] = layout
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
              seed=args.seed, async_scheduling=ASYNC[args.async_scheduling])
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
        res["host_ms"] = 1e3 * statistics.median(s.host_overhead for s in steps)
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


def _bench_moe():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "kernels"))
    import bench_moe

    return bench_moe


def floor_ms(runner, b: int, context: int) -> float:
    """Bytes floor of this model's decode step at b requests of `context` tokens (benchmarks/kernels/bench_moe.py:
    weights read once, experts touched at uniform routing, bf16 KV) at PERF.md's 4.3 TB/s."""
    m = _bench_moe()
    return m.model_floor_bytes(runner.model, runner.config, b, context) / m.HBM * 1e3


class RoutingCounter:
    """Counts, on the device, the distinct experts each Router call picked: a forward hook per Router module
    appends (rows, layer, a device scalar). Nothing is read back until `per_step`, so it adds no sync."""

    def __init__(self, model) -> None:
        from msa.moe import Router

        self.calls: list[tuple[int, int, torch.Tensor]] = []
        self._hooks = [mod.register_forward_hook(self._hook(i))
                       for i, mod in enumerate(m for m in model.modules() if isinstance(m, Router))]
        self.num_layers = len(self._hooks)

    def _hook(self, layer: int):
        def record(module, inputs, out):
            ids = out[0]
            hit = torch.zeros(module.weight.shape[0], dtype=torch.int32, device=ids.device)
            hit.index_fill_(0, ids.reshape(-1), 1)
            self.calls.append((ids.shape[0], layer, hit.sum()))
        return record

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def per_step(self, rows: int) -> list[list[int]]:
        """Touched experts per MoE layer for every step of `rows` rows, in step order."""
        picked = [(layer, n) for r, layer, n in self.calls if r == rows]
        counts = torch.stack([n for _, n in picked]).tolist() if picked else []
        steps: list[list[int]] = []
        for (layer, _), c in zip(picked, counts):
            if layer == 0:
                steps.append([])
            steps[-1].append(c)
        return [s for s in steps if len(s) == self.num_layers]


def routed_floor_ms(runner, b: int, context: int, touched_per_step: list[list[int]]) -> float | None:
    """The bytes floor of what the steps read: bench_moe's count with uniform routing's expected experts swapped
    for the ones each step touched (mean over steps)."""
    if not touched_per_step:
        return None
    m, cfg = _bench_moe(), runner.config
    expert_bytes = 3 * cfg.intermediate_size * cfg.hidden_size * 2
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    uniform_experts = len(cfg.moe_layers) * e * (1 - (1 - k / e) ** b)
    base = m.model_floor_bytes(runner.model, cfg, b, context) - uniform_experts * expert_bytes
    mean_touched = statistics.mean(sum(s) for s in touched_per_step)
    return (base + mean_touched * expert_bytes) / m.HBM * 1e3


def count_routing(llm, prompts, args, b: int) -> dict:
    """An untimed eager pass of the same requests with a RoutingCounter on: touched experts per decode step."""
    from workers.request import SamplingParams

    runner = llm.engine.executor.runner
    graphs, runner.graphs = runner.graphs, None
    counter = RoutingCounter(runner.model)
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True))
        steps = counter.per_step(b)
    finally:
        counter.remove()
        runner.graphs = graphs
    flat = [n for s in steps for n in s]
    return {"steps": len(steps), "mean_touched_per_layer": statistics.mean(flat) if flat else None,
            "max_touched_per_layer": max(flat) if flat else None, "touched_per_step": steps}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return {"identical_requests": same, "requests": len(a), "mean_matching_prefix": statistics.mean(prefix)}


def batch_prompts(args, b: int, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed + b)
    return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]


def bench_batch(llm, args, b: int, vocab: int) -> tuple[dict, list[list[int]] | None]:
    """-> (the row, the graph run's tokens per request)."""
    prompts = [{"prompt_token_ids": p} for p in batch_prompts(args, b, vocab)]
    runner = llm.engine.executor.runner
    graphs = runner.graphs
    perf = not args.tiny and args.num_experts == 128  # PERF.md's numbers are for the full expert count
    context = args.prompt_len + args.decode_tokens // 2
    routing = count_routing(llm, prompts, args, b)
    row = {"B": b, "bucket": graphs.bucket(b) if graphs is not None else None,
           "floor_ms": routed_floor_ms(runner, b, context, routing["touched_per_step"]),
           "uniform_floor_ms": floor_ms(runner, b, context),
           "routing": {k: v for k, v in routing.items() if k != "touched_per_step"},
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
    return row, tokens.get("graphs")


def profile_decode(llm, prompts, args, b: int, steps: int = 4) -> str:
    """Kernel table (device time by kernel, torch profiler) of `steps` eager decode steps of b rows, then of as
    many replays of b's graph. The requests are added and prefilled first, outside the profile."""
    from torch.profiler import ProfilerActivity, profile

    from workers.request import SamplingParams

    eng, runner = llm.engine, llm.engine.executor.runner
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"profile-{b}-{i}", p["prompt_token_ids"], params)
    graphs, runner.graphs = runner.graphs, None
    parts = []
    try:
        eng.pop_step_stats()
        while not _decoding(eng):
            pass
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        parts.append(f"== eager decode, B={b}, {steps} steps\n" + prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
    finally:
        runner.graphs = graphs
        while eng.has_unfinished():
            eng.step()
    if graphs is not None:
        bucket = graphs.bucket(b)
        graphs.replay(bucket)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                graphs.replay(bucket)
            torch.cuda.synchronize()
        parts.append(f"== graph replay, bucket {bucket}, {steps} replays\n" + prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
    return "\n".join(parts)


def _decoding(eng) -> bool:
    """Steps the engine once; True if that was a pure decode step (every prompt done)."""
    eng.step()
    stats = eng.pop_step_stats()
    return bool(stats) and stats[-1].num_prefill_tokens == 0


# ---- report -----------------------------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def _agree(a: dict | None) -> str:
    return f"{a['identical_requests']}/{a['requests']}" if a else "-"


def format_table(doc: dict) -> str:
    head = (f"engine decode, {doc['model']['preset']} ({doc['model'].get('num_local_experts', '-')} experts), "
            f"prompt {doc['prompt_len']}, {doc['decode_tokens']} tokens, {doc['device_name']}; "
            f"graphs {doc['graph_sizes']} captured in {_f(doc['capture_s'])} s")
    cols = ("B", "eager step ms", "graph step ms", "speedup", "eager fwd ms", "graph fwd ms", "replay ms",
            "routed floor", "replay/floor", "uniform floor", "experts/layer", "target", "same reqs",
            "hf step ms", "hf same reqs")
    lines = [head, " | ".join(cols)]
    for r in doc["rows"]:
        e, g, agree = r.get("eager", {}), r.get("graphs", {}), r.get("agreement")
        cells = (str(r["B"]), _f(e.get("step_ms")), _f(g.get("step_ms")), _f(r.get("step_speedup"), "{:.2f}x"),
                 _f(e.get("forward_ms")), _f(g.get("forward_ms")), _f(g.get("replay_ms")),
                 _f(r["floor_ms"]), _ratio(g.get("replay_ms"), r["floor_ms"]), _f(r["uniform_floor_ms"]),
                 _f(r["routing"]["mean_touched_per_layer"], "{:.1f}"), _f(r["perf_target_ms"]),
                 _agree(agree),
                 _f(r.get("hf", {}).get("step_ms")), _agree(r.get("hf", {}).get("agreement_with_graphs")))
        lines.append(" | ".join(c.rjust(len(h)) for c, h in zip(cells, cols)))
    return "\n".join(lines)


def hf_reference_rows(args, model_dir: Path) -> dict[int, dict]:
    """transformers' decode on the same weights and prompts (benchmarks/hf_reference.py), in a process of its own
    and before the engine starts: {B: its result, tokens included}."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hf_reference

    vocab = slice_config(args).vocab_size
    prompts = {b: batch_prompts(args, b, vocab) for b in args.batches}
    return hf_reference.run_in_subprocess(model_dir, prompts, args.decode_tokens, device=args.device)


def add_hf_reference(doc: dict, hf: dict[int, dict], graph_tokens: dict) -> None:
    """Each row's "hf": transformers' step and its tokens' agreement with the engine's graph run."""
    for row in doc["rows"]:
        res = dict(hf[row["B"]])
        tokens, ours = res.pop("tokens", None), graph_tokens.get(row["B"])
        if tokens is not None and ours is not None:
            res["agreement_with_graphs"] = agreement(ours, tokens)
        row["hf"] = res


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
    hf = hf_reference_rows(args, model_dir) if args.hf_reference and not args.tiny else None
    llm, build_s = build_llm(args, model_dir)
    runner = llm.engine.executor.runner
    info = runner.info()
    doc = {"model": model_info, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
           "max_model_len": args.max_model_len, "async_scheduling": llm.engine.engine_config.async_scheduling,
           "device_name": torch.cuda.get_device_name() if args.device == "cuda"
           else "cpu", "engine_build_s": build_s, "graph_sizes": info["cuda_graph_sizes"],
           "capture_s": info["cuda_graph_capture_s"],
           "graph_pool_mib": runner.graphs.pool_bytes / 2**20 if runner.graphs is not None else None,
           "num_pages": info["num_pages"], "rows": []}
    _say(f"engine up in {build_s:.1f} s; graphs {doc['graph_sizes']} captured in {_f(doc['capture_s'])} s")
    save(doc, args.out)
    graph_tokens = {}
    for b in args.batches:
        row, graph_tokens[b] = bench_batch(llm, args, b, runner.config.vocab_size)
        _say(json.dumps(row))
        doc["rows"].append(row)
        save(doc, args.out)
        if b in args.profile and args.device == "cuda":
            rng = random.Random(args.seed + b)
            prompts = [{"prompt_token_ids": [rng.randrange(3, runner.config.vocab_size)
                                             for _ in range(args.prompt_len)]} for _ in range(b)]
            table = profile_decode(llm, prompts, args, b)
            if args.out:
                (Path(args.out) / f"profile_B{b}.txt").write_text(table + "\n")
            _say(f"profile of B={b} written")
    llm.engine.shutdown()
    if hf is not None:
        add_hf_reference(doc, hf, graph_tokens)
        save(doc, args.out)
    print(format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
