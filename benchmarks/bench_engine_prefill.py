"""Engine prefill: TTFT of single long prompts and the throughput of many concurrent prompts, floors beside them.

Issue 18's end-to-end measure: one in-process Engine (workers.engine.Engine, local executor: no Ray) on one GPU,
the m3-slice preset (configs/models/m3-slice.yaml: full per-layer M3 shapes, 4 layers: 1 dense + 3 MSA/MoE) with
all 128 experts, bf16, random weights. The weights are drawn on the GPU per checkpoint key and narrowed by each
parameter's weight loader (benchmarks/bench_parallel.py's build_random_model), so no 50 GB checkpoint is written
or read: the model directory holds config.json and the tokenizer only, and the runner's `load_model` is swapped
for the random build while the engine starts (--ckpt-dir loads a real checkpoint instead). Default engine
settings otherwise (gpu_memory_utilization, decode CUDA graphs), except prefix caching off (a repeat must not hit
the cache) and max_num_batched_tokens = --chunk (chunked prefill splits longer prompts).

Phases, each followed by a JSON write (--out, default $OUT):
  ttft        per length of --lengths (default 1024,8192,32768,131072): one warm-up prompt (Triton compiles per
              shape), then --repeats prompts (fresh random token ids and request id each), max_tokens=1, greedy;
              TTFT = wall clock from add_request until engine.step() returned the request's first token (the
              runner synchronises CUDA every step). Median reported. Lengths above 32768 run after the
              throughput phase (the GPU call has a 10-minute limit): --budget-s skips what would start past it.
  throughput  --tput-prompts (64) prompts of --tput-len (1024) tokens added together, stepped until every one
              has its first token (after one warm-up round); prompt tokens / wall, and the fraction of the FLOP
              ceiling that is (FLOP floor / wall).
  profile     --profile LENGTH: one prompt (--profile-prompts N: N added together) under torch.profiler (CUDA
              activities) after a warm-up; the top 25 kernels by self device time printed and written to --out
              (bench_engine_prefill_profile.txt).

Floors (PERF.md; benchmarks/prefill_floor.py says how): FLOPs at 790 TFLOP/s and weight bytes at 4.3 TB/s, per
engine step from the chunks the scheduler actually ran (recorded), max of the two, summed; both parts reported.
A step of more than a few hundred tokens touches all 128 routed experts (14.5 GB per MoE layer).

  PYTHONPATH=$PWD python3 benchmarks/bench_engine_prefill.py --out $OUT                       # one H200
  PYTHONPATH=$PWD python3 benchmarks/bench_engine_prefill.py --chunk 2048 --lengths 1024,8192,32768
  PYTHONPATH=$PWD python3 benchmarks/bench_engine_prefill.py --attention-backend ref --lengths 1024,8192
  PYTHONPATH=$PWD python3 benchmarks/bench_engine_prefill.py --profile 8192 --lengths 8192 --tput-prompts 0
  PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_engine_prefill.py --tiny --device cpu      # CPU smoke run
Prints a table last: length | chunk | TTFT ms (median) | floor ms | floor/TTFT | goal.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

_BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH.parent))  # the repository root (workers, msa)
sys.path.insert(0, str(_BENCH))  # bench_parallel (the random model build), prefill_floor
from prefill_floor import (HBM_BPS, PEAK_FLOPS, active_params, floor_of_steps, model_param_counts,  # noqa: E402
                           params_per_token, planned_steps)

ASYNC = {"auto": None, "on": True, "off": False}  # --async-scheduling -> EngineConfig
RESULT_NAME = "bench_engine_prefill.json"
PROFILE_NAME = "bench_engine_prefill_profile.txt"
TTFT_GOALS_MS = {8192: 70.0, 32768: 300.0}  # issue 18 (128k: completes at default memory settings)
TPUT_GOAL = 0.60  # of the FLOP ceiling, 64 x 1k prompts
LONG = 32768  # lengths above this run after the throughput phase


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny preset in fp32 (CPU smoke run)")
    p.add_argument("--lengths", default=None, help="prompt lengths for TTFT (default 1024,8192,32768,131072; "
                   "tiny 40,100)")
    p.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (default 8192; tiny 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tput-prompts", type=int, default=None, help="concurrent prompts (default 64; tiny 4; 0 = "
                   "skip the phase)")
    p.add_argument("--tput-len", type=int, default=None, help="tokens per concurrent prompt (default 1024; tiny 40)")
    p.add_argument("--profile", type=int, default=0, metavar="LENGTH", help="profile one prompt of LENGTH tokens")
    p.add_argument("--profile-prompts", type=int, default=1, metavar="N",
                   help="profile N such prompts added together (8 x 1024: one throughput step)")
    p.add_argument("--attention-backend", choices=("auto", "ref", "triton"), default="auto")
    p.add_argument("--num-experts", type=int, default=None, help="override num_local_experts (default: the "
                   "preset's, 128 for m3-slice)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bfloat16 (tiny float32)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: EngineConfig's")
    p.add_argument("--enforce-eager", action="store_true", help="no decode CUDA graphs (default: captured, as "
                   "served; no decode step runs here)")
    p.add_argument("--ckpt-dir", default=None, help="load this checkpoint (written first if it holds none) "
                   "instead of drawing the weights on the device")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall budget from start: later phases/lengths "
                   "and repeats that would start past it are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="EngineConfig.async_scheduling: step n+1 scheduled and launched while step n runs "
                        "(auto: the engine's default, on for CUDA)")
    p.add_argument("--out", default=os.environ.get("OUT"), help=f"directory for {RESULT_NAME}")
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in (a.lengths or ("40,100" if a.tiny else "1024,8192,32768,131072")).split(",")]
    a.chunk = a.chunk or (64 if a.tiny else 8192)
    a.tput_prompts = (4 if a.tiny else 64) if a.tput_prompts is None else a.tput_prompts
    a.tput_len = a.tput_len or (40 if a.tiny else 1024)
    a.dtype = a.dtype or ("float32" if a.tiny else "bfloat16")
    return a


def _say(msg: str) -> None:
    print(f"[bench_engine_prefill] {msg}", flush=True)


# ---- model and engine -----------------------------------------------------------------------------------------

def model_config(args):
    from workers.models import preset_config

    cfg = preset_config("tiny" if args.tiny else "m3-slice")
    if args.num_experts:
        cfg = dataclasses.replace(cfg, num_local_experts=args.num_experts)
    return dataclasses.replace(cfg, torch_dtype=args.dtype)


def write_model_dir(cfg, out_dir: str | Path) -> Path:
    """A checkpoint directory without weights: config.json, generation_config.json and the tokenizer (what the
    engine reads besides the weights); `random_weights` supplies the weights."""
    from msa.checkpoint import HUB, config_json, write_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(cfg, out)
    (out / "config.json").write_text(json.dumps(config_json(cfg, HUB), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_id), "pad_token_id": special.pad_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


@contextlib.contextmanager
def random_weights(seed: int = 0):
    """While open, a ModelRunner builds its model from random weights drawn on its device (bench_parallel's
    build_random_model: per-key seeds, weight loaders) instead of reading the checkpoint's safetensors."""
    import workers.runner as runner_mod
    from bench_parallel import build_random_model
    from msa.config import load_config
    from msa.parallel import ParallelContext

    if not hasattr(runner_mod, "load_model"):
        raise RuntimeError("workers.runner no longer calls load_model: update random_weights()")

    def load_random(model_dir, *, device="cpu", dtype=torch.float32, ctx=None):
        model = build_random_model(load_config(model_dir), ctx or ParallelContext.single(), dtype,
                                   torch.device(device), seed)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the draws' cached blocks back to the device: the KV pool sizes from free
        return model

    saved = runner_mod.load_model
    runner_mod.load_model = load_random
    try:
        yield
    finally:
        runner_mod.load_model = saved


def prepare_model(args, cfg) -> tuple[Path, bool, dict]:
    """(model directory, whether its weights are drawn at engine start, info)."""
    info = {"preset": "tiny" if args.tiny else "m3-slice", "num_local_experts": cfg.num_local_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "dtype": args.dtype}
    if args.ckpt_dir:
        out = Path(args.ckpt_dir)
        if not (out / "model.safetensors.index.json").is_file():
            from msa.checkpoint import write_checkpoint

            t0 = time.perf_counter()
            write_checkpoint(cfg, out, seed=args.seed, dtype=getattr(torch, args.dtype), num_shards=4,
                             device=args.device)
            info["write_s"] = time.perf_counter() - t0
        return out, False, info | {"weights": f"checkpoint {out}"}
    out = write_model_dir(cfg, tempfile.mkdtemp(prefix="m3-prefill-", dir="/tmp"))
    return out, True, info | {"weights": "random, drawn on the device (bench_parallel.build_random_model)"}


def build_engine(args, model_dir: Path, drawn: bool, max_model_len: int, max_num_seqs: int = 64):
    from workers.config import EngineConfig
    from workers.engine import Engine

    fields = dict(max_model_len=max_model_len, max_num_batched_tokens=args.chunk, max_num_seqs=max_num_seqs,
                  enable_prefix_caching=False, dtype=args.dtype, seed=args.seed,
                  attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                  async_scheduling=ASYNC[args.async_scheduling])
    if args.gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = args.gpu_memory_utilization
    config = EngineConfig(**fields)
    with random_weights(args.seed) if drawn else contextlib.nullcontext():
        return Engine(model_dir, engine_config=config, device=args.device, executor="local")


class ScheduleLog:
    """Records the chunks of every step the engine schedules: (start, num_tokens, sampled) per chunk."""

    def __init__(self, engine) -> None:
        self.steps: list[list[tuple[int, int, bool]]] = []
        inner = engine.scheduler.schedule

        def schedule():
            out = inner()
            if not out.is_empty:
                self.steps.append([(c.start, c.num_tokens, c.sample) for c in out.chunks])
            return out

        engine.scheduler.schedule = schedule

    def take(self) -> list[list[tuple[int, int, bool]]]:
        steps, self.steps = self.steps, []
        return steps


# ---- measurement ----------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, engine, cfg, dtype_bytes: int) -> None:
        self.args, self.engine, self.cfg, self.dtype_bytes = args, engine, cfg, dtype_bytes
        self.log = ScheduleLog(engine)
        self.rng = random.Random(args.seed)
        self.ids = 0
        self.cuda = args.device == "cuda"

    def prompt(self, n: int) -> list[int]:
        vocab = self.cfg.vocab_size
        return [self.rng.randrange(3, vocab - 1) for _ in range(n)]

    def run(self, lengths: list[int]) -> dict:
        """Add one request per length at once, step until each has its first token -> wall time, per-request
        TTFT, the steps' chunks and stats. Any exception aborts the requests (the engine stays usable)."""
        from workers.request import SamplingParams

        eng = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompts = {}
        for n in lengths:
            self.ids += 1
            prompts[f"prefill-{self.ids}"] = self.prompt(n)
        self.log.take()
        eng.pop_step_stats()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            before = _alloc_counters()
        first: dict[str, float] = {}
        failed: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            for rid, ids in prompts.items():
                eng.add_request(rid, ids, params)
            while len(first) + len(failed) < len(prompts):
                outs = eng.step()
                now = time.perf_counter()
                for out in outs:
                    rid = out.request_id
                    if rid not in prompts or rid in first or rid in failed:
                        continue
                    if out.outputs and out.outputs[0].token_ids:
                        first[rid] = now - t0
                    elif out.finished:
                        failed[rid] = _no_token(out)
                if not outs and not eng.has_unfinished() and len(first) + len(failed) < len(prompts):
                    raise RuntimeError("engine idle while requests have no first token")
            wall = time.perf_counter() - t0
            while eng.has_unfinished():
                eng.step()
        except BaseException:
            for rid in prompts:
                eng.abort_request(rid)
            self.log.take()
            raise
        stats = eng.pop_step_stats()
        res = {"wall_s": wall, "ttft_s": [first.get(rid) for rid in prompts], "failed": list(failed.values()),
               "steps": self.log.take(), "num_steps": len(stats),
               "forward_s": sum(s.step_time - s.host_overhead for s in stats),
               "host_s": sum(s.host_overhead for s in stats)}
        if self.cuda:
            res["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
            # cudaMalloc / cudaFree inside a step synchronise the device and expose every later launch
            res["allocator"] = {k: v - before[k] for k, v in _alloc_counters().items()}
        return res

    def floor(self, steps) -> dict:
        return floor_of_steps(self.cfg, steps, self.dtype_bytes)


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _alloc_counters() -> dict[str, int]:
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def _oom(e: BaseException) -> bool:
    return isinstance(e, _OOM) or "out of memory" in str(e).lower()


def _failure(e: BaseException, what: str) -> str:
    """The error text of a failed phase (printed; the traceback too unless it is a plain CUDA OOM)."""
    text = ("CUDA OOM: " if _oom(e) else "") + f"{type(e).__name__}: {str(e)[:500]}"
    _say(f"{what}: {text}")
    if not _oom(e):
        traceback.print_exc()
    return text


def _no_token(out) -> str:
    """Why a request finished without a token: the engine's step error (a step that raised fails only its
    requests, `RequestOutput.error`), else its finish reason."""
    err = getattr(out, "error", None)
    if err is None:
        return f"finished without a token ({out.outputs[0].finish_reason if out.outputs else '-'})"
    oom = getattr(err, "out_of_memory", False) or _oom(err)
    return ("CUDA OOM: " if oom else "") + f"{type(err).__name__}: {str(err)[:500]}"


def _recover(bench: Bench) -> None:
    if bench.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _warm_then_repeat(bench, lengths: list[int], row: dict, repeats: int, deadline: float) -> list[dict]:
    """One warm-up run of `lengths` (kernels compile per shape), then up to `repeats` timed runs while the next
    one fits before `deadline`. Writes warmup_ms, a warm-up failure ("error") or a budget note into `row`."""
    warm = bench.run(lengths)
    row["warmup_ms"] = 1e3 * warm["wall_s"]
    if warm["failed"]:
        row["error"] = "warm-up: " + "; ".join(sorted(set(warm["failed"])))
    runs: list[dict] = []
    while len(runs) < repeats and "error" not in row:
        last = runs[-1]["wall_s"] if runs else warm["wall_s"]
        if runs and time.perf_counter() + last > deadline:
            row["note"] = f"budget: {len(runs)} of {repeats} repeats"
            break
        runs.append(bench.run(lengths))
    return runs


def ttft_length(bench: Bench, length: int, deadline: float) -> dict:
    args = bench.args
    row = {"length": length, "chunk": args.chunk, "goal_ms": TTFT_GOALS_MS.get(length),
           "planned_floor": bench.floor(planned_steps(length, args.chunk))}
    t0 = time.perf_counter()
    try:
        runs = _warm_then_repeat(bench, [length], row, args.repeats, deadline)
    except Exception as e:  # noqa: BLE001 - one length failing must not end the benchmark
        row["error"] = _failure(e, f"length {length}")
    if "error" in row:  # outside the handler: the exception's frames (and their tensors) are gone by now
        _recover(bench)
        return row
    if any(r["failed"] for r in runs):
        row["error"] = "; ".join(f for r in runs for f in r["failed"])
        _recover(bench)
    ok = [r for r in runs if not r["failed"]]
    row["repeats"] = len(ok)
    row["elapsed_s"] = time.perf_counter() - t0
    if ok:
        row["ttft_ms"] = [1e3 * r["ttft_s"][0] for r in ok]
        row["ttft_ms_median"] = statistics.median(row["ttft_ms"])
        best = min(ok, key=lambda r: r["wall_s"])
        row["num_steps"] = best["num_steps"]
        row["chunks"] = [[n for _, n, _ in s] for s in best["steps"]]
        row["forward_ms"] = 1e3 * best["forward_s"]
        row["host_ms"] = 1e3 * best["host_s"]
        row["allocator"] = best.get("allocator")
        if "peak_alloc_gib" in best:
            row["peak_alloc_gib"] = max(r["peak_alloc_gib"] for r in ok)
        row["floor"] = bench.floor(best["steps"])
        row["floor_over_ttft"] = row["floor"]["floor_ms"] / row["ttft_ms_median"]
        row["flop_floor_over_ttft"] = row["floor"]["flop_ms"] / row["ttft_ms_median"]
    return row


def throughput(bench: Bench, deadline: float) -> dict:
    args = bench.args
    n, length = args.tput_prompts, args.tput_len
    row = {"prompts": n, "prompt_len": length, "chunk": args.chunk, "goal_fraction": TPUT_GOAL}
    try:
        runs = _warm_then_repeat(bench, [length] * n, row, args.repeats, deadline)
    except Exception as e:  # noqa: BLE001
        row["error"] = _failure(e, "throughput")
    if "error" in row:
        _recover(bench)
        return row
    ok = [r for r in runs if not r["failed"]]
    if len(ok) < len(runs):
        row["error"] = "; ".join(sorted({f for r in runs for f in r["failed"]}))
        _recover(bench)
    if not ok:
        return row
    walls = [r["wall_s"] for r in ok]
    med = sorted(ok, key=lambda r: r["wall_s"])[len(ok) // 2]
    row["wall_ms"] = [1e3 * w for w in walls]
    row["wall_ms_median"] = 1e3 * statistics.median(walls)
    row["tok_per_s"] = n * length / (row["wall_ms_median"] / 1e3)
    row["num_steps"] = med["num_steps"]
    row["tokens_per_step"] = [sum(c for _, c, _ in s) for s in med["steps"]]
    row["ttft_ms_p50"] = 1e3 * statistics.median(t for t in med["ttft_s"] if t is not None)
    row["forward_ms"] = 1e3 * med["forward_s"]
    row["host_ms"] = 1e3 * med["host_s"]
    row["allocator"] = med.get("allocator")
    if "peak_alloc_gib" in med:
        row["peak_alloc_gib"] = med["peak_alloc_gib"]
    row["floor"] = bench.floor(med["steps"])
    row["flop_fraction"] = row["floor"]["flop_ms"] / row["wall_ms_median"]  # of the FLOP ceiling
    row["floor_over_wall"] = row["floor"]["floor_ms"] / row["wall_ms_median"]
    return row


def profile(bench: Bench, length: int, out: str | None, prompts: int = 1) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    res = {"length": length, "prompts": prompts, "chunk": bench.args.chunk}
    try:
        bench.run([length] * prompts)  # warm-up (compiles for this shape)
        acts = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if bench.cuda else [ProfilerActivity.CPU]
        with torch_profile(activities=acts, with_stack=bench.cuda) as prof:
            run = bench.run([length] * prompts)
    except Exception as e:  # noqa: BLE001
        res["error"] = _failure(e, "profile")
    if "error" in res:
        _recover(bench)
        return res
    if run["failed"]:
        res["error"] = "; ".join(run["failed"])
    res["ttft_ms"] = 1e3 * run["ttft_s"][0] if run["ttft_s"][0] is not None else None
    res["num_steps"] = run["num_steps"]

    def self_us(e) -> float:
        if bench.cuda:
            v = getattr(e, "self_device_time_total", None)
            return v if v is not None else getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    events = [e for e in prof.key_averages() if self_us(e) > 0]
    events.sort(key=self_us, reverse=True)
    total = sum(self_us(e) for e in events)
    res["total_self_ms"] = total / 1e3
    res["top"] = [{"name": e.key, "self_ms": self_us(e) / 1e3, "calls": e.count} for e in events[:25]]
    what = f"one {length}-token prompt" if prompts == 1 else f"{prompts} x {length}-token prompts"
    lines = [f"profile: {what}, chunk {bench.args.chunk}, TTFT {_f(res['ttft_ms'])} ms, "
             f"{run['num_steps']} steps; self {'device' if bench.cuda else 'CPU'} time {total / 1e3:.2f} ms total",
             f"{'self ms':>10} {'%':>6} {'calls':>6}  kernel"]
    for t in res["top"]:
        lines.append(f"{t['self_ms']:10.3f} {100 * t['self_ms'] / max(total / 1e3, 1e-9):6.1f} {t['calls']:6d}  "
                     f"{t['name'][:140]}")
    if bench.cuda:  # host side: launches, allocations and synchronisations (the gaps between kernels)
        host = sorted((e for e in prof.key_averages() if e.key.startswith("cuda")),
                      key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        res["runtime"] = [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in host]
        lines.append(f"{'cpu ms':>10} {'':>6} {'calls':>6}  CUDA runtime call")
        lines += [f"{e['self_cpu_ms']:10.3f} {'':>6} {e['calls']:6d}  {e['name'][:100]}" for e in res["runtime"]]
        lines.append(_idle_time(prof, out, res))
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / PROFILE_NAME).write_text(text + "\n")
    return res


def _idle_time(prof, out: str | None, res: dict) -> str:
    """The GPU's idle gaps in the profiled run and the host functions overlapping them (trace_gaps.py); the
    trace itself is kept gzipped under --out."""
    import gzip

    from trace_gaps import format_summary, idle_summary, load_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = idle_summary(load_trace(path))
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as src, gzip.open(Path(out) / "bench_engine_prefill_trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    res["idle"] = {k: summary[k] for k in ("span_us", "busy_us", "idle_us")}
    return format_summary(summary)


# ---- report ---------------------------------------------------------------------------------------------------

def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(doc: dict) -> str:
    m = doc["model"]
    head = (f"engine prefill, {m['preset']} ({m['num_local_experts']} experts, {m['dtype']}), attention "
            f"{doc['attention_backend']}, {doc['device_name']}; floor = sum over steps of max(FLOPs / 790 TFLOP/s, "
            f"weight bytes / 4.3 TB/s)")
    cols = ("length", "chunk", "TTFT ms (median)", "floor ms", "floor/TTFT", "goal")
    lines = [head, " | ".join(cols)]
    for r in doc["ttft"]:
        fl = r.get("floor") or r["planned_floor"]
        goal = f"<= {r['goal_ms']:.0f} ms" if r.get("goal_ms") else ("completes" if r["length"] > LONG else "-")
        ttft = _f(r.get("ttft_ms_median")) if "ttft_ms_median" in r else (
            "skipped" if r.get("skipped") else "error")
        cells = (str(r["length"]), str(r["chunk"]), ttft,
                 f"{_f(fl['floor_ms'])} (flop {_f(fl['flop_ms'])}, bytes {_f(fl['byte_ms'])})",
                 _f(r.get("floor_over_ttft")), goal)
        lines.append(" | ".join(c.rjust(len(h)) for c, h in zip(cells, cols)))
    t = doc.get("throughput")
    if t:
        if "wall_ms_median" in t:
            fl = t["floor"]
            lines.append(f"{t['prompts']} x {t['prompt_len']} prompts, chunk {t['chunk']}: "
                         f"{_f(t['wall_ms_median'])} ms, {_f(t['tok_per_s'], '{:.0f}')} tok/s; FLOP floor {_f(fl['flop_ms'])} ms -> "
                         f"{_f(100 * t['flop_fraction'], '{:.1f}')}% of the FLOP ceiling (goal >= "
                         f"{100 * TPUT_GOAL:.0f}%); bytes floor {_f(fl['byte_ms'])} ms, floor {_f(fl['floor_ms'])} ms "
                         f"= {_f(100 * t['floor_over_wall'], '{:.1f}')}% of wall")
        else:
            lines.append(f"{t['prompts']} x {t['prompt_len']} prompts: {t.get('error') or 'skipped'}")
    return "\n".join(lines)


def save(doc: dict, out: str | None) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / RESULT_NAME).write_text(json.dumps(doc, indent=2) + "\n")


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    deadline = t_start + args.budget_s
    if args.device == "cuda" and not torch.cuda.is_available():
        _say("no CUDA device (use --device cpu --tiny for the smoke run)")
        return 2
    if args.device == "cpu":
        torch.set_num_threads(1)  # the tiny smoke run: intra-op threads only fight over a small machine's cores
    cfg = model_config(args)
    model_dir, drawn, model_info = prepare_model(args, cfg)
    max_len = max([*args.lengths, args.tput_len, args.profile]) + 1
    t0 = time.perf_counter()
    engine = build_engine(args, model_dir, drawn, max_len, max_num_seqs=max(64, args.tput_prompts))
    build_s = time.perf_counter() - t0
    runner = engine.executor.runner
    info = runner.info()
    dtype_bytes = torch.tensor([], dtype=runner.dtype).element_size()
    model_info["param_check"] = {"config": {k: v for k, v in active_params(cfg).items()},
                                 "config_per_token": params_per_token(cfg),
                                 "model": model_param_counts(runner.model)}
    doc = {"model": model_info, "attention_backend": args.attention_backend, "chunk": args.chunk,
           "async_scheduling": engine.engine_config.async_scheduling,
           "max_model_len": engine.engine_config.max_model_len,
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "engine_build_s": build_s, "num_pages": info["num_pages"],
           "page_size": info["page_size"], "kv_gib": info["kv_bytes"] / 2**30,
           "cuda_graph_sizes": info["cuda_graph_sizes"], "cuda_graph_capture_s": info["cuda_graph_capture_s"],
           "peak_flops": PEAK_FLOPS, "hbm_bps": HBM_BPS,
           "ttft": [], "throughput": None, "profile": None}
    if args.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        doc["gpu_free_gib_after_build"], doc["gpu_total_gib"] = free / 2**30, total / 2**30
    _say(f"engine up in {build_s:.1f} s ({model_info['weights']}); {info['num_pages']} pages "
         f"({doc['kv_gib']:.1f} GiB KV), params/token {params_per_token(cfg) / 1e9:.3f} B")
    save(doc, args.out)

    bench = Bench(args, engine, cfg, dtype_bytes)
    short = [n for n in args.lengths if n <= LONG]
    long_ = [n for n in args.lengths if n > LONG]

    def do_lengths(lengths):
        for n in lengths:
            if time.perf_counter() > deadline:
                doc["ttft"].append({"length": n, "chunk": args.chunk, "goal_ms": TTFT_GOALS_MS.get(n),
                                    "skipped": "budget", "planned_floor": bench.floor(planned_steps(n, args.chunk))})
                _say(f"length {n}: skipped (budget)")
            else:
                row = ttft_length(bench, n, deadline)
                _say(json.dumps({k: v for k, v in row.items() if k not in ("chunks", "planned_floor")}))
                doc["ttft"].append(row)
            save(doc, args.out)

    do_lengths(short)
    if args.tput_prompts > 0:
        if time.perf_counter() > deadline:
            doc["throughput"] = {"prompts": args.tput_prompts, "prompt_len": args.tput_len, "skipped": "budget"}
        else:
            doc["throughput"] = throughput(bench, deadline)
            _say(json.dumps({k: v for k, v in doc["throughput"].items() if k != "tokens_per_step"}))
        save(doc, args.out)
    do_lengths(long_)
    if args.profile:
        doc["profile"] = (profile(bench, args.profile, args.out, args.profile_prompts)
                          if time.perf_counter() < deadline else {"length": args.profile, "skipped": "budget"})
        save(doc, args.out)
    doc["total_s"] = time.perf_counter() - t_start
    save(doc, args.out)
    engine.shutdown()
    if drawn:  # the weightless model directory written above (config + tokenizer)
        shutil.rmtree(model_dir, ignore_errors=True)
    print(format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
