"""Which Triton kernels compile after the engine started: the source of multi-second steps mid-serving.

docs/benchmarks.md D4 saw steps of 1.8-7.7 s in the middle of a serving run, in the Serve replica and in-process:
Triton compiling a kernel variant the startup (profile step, decode graph capture) and the benchmark's warm-up had
not met. This probe starts one in-process engine (m3-slice with --num-experts, bf16, the engine's defaults) with
Triton's JIT hooks on (`triton.knobs.runtime.jit_cache_hook` fires on every in-process cache miss, before the
compile or the on-disk cache load; `jit_post_compile_hook` after), then drives a serving-like mix through it:
prompts of many lengths (1 token to several chunks, multiples of 16 and not) arriving while others decode, n > 1,
logprobs, a penalty, seeded sampling. Reported: per phase (startup, warm-up, serving) how many kernel variants were
built and the seconds it took; for the serving phase each one with its step, its kernel and its specialisation
(Triton specialises integer arguments on == 1 and divisibility by 16, and every constexpr value compiles anew).
Run with a fresh `TRITON_CACHE_DIR` to see compile times rather than disk-cache loads.

  TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD python3 benchmarks/probe_compiles.py --out $OUT   # one GPU, ~2 min
  PYTHONPATH=$PWD .venv/bin/python benchmarks/probe_compiles.py --device cpu --tiny                 # smoke run
Writes probe_compiles.json to --out; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT_NAME = "probe_compiles.json"
SLOW_S = 0.2  # a cache miss that took longer than this compiled (a disk-cache load takes milliseconds)


class CompileLog:
    """Triton's JIT hooks -> one record per in-process cache miss: (phase, step, kernel, specialisation, seconds)."""

    def __init__(self) -> None:
        self.phase, self.step = "startup", 0
        self.records: list[dict] = []
        self._started: dict[str, float] = {}

    def install(self) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook = self._before
        triton.knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        self._started[str(key)] = time.perf_counter()
        return None  # go on and compile

    def _after(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        now = time.perf_counter()
        t0 = self._started.pop(str(key), now)
        # `repr` names the launch options only (Triton 3.6 cuts the argument part short); the key holds every
        # argument's specialisation and the constexprs: what tells two variants apart
        self.records.append({"phase": self.phase, "step": self.step, "kernel": fn.name,
                             "specialization": repr, "key": str(key), "seconds": now - t0})

    def summary(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.records:
            s = out.setdefault(r["phase"], {"variants": 0, "compiled": 0, "seconds": 0.0})
            s["variants"] += 1
            s["compiled"] += r["seconds"] > SLOW_S
            s["seconds"] += r["seconds"]
        return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny preset in fp32 (CPU smoke run: no Triton)")
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory: written if it holds none, else reused")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT"), help=f"directory for {RESULT_NAME}")
    return p.parse_args(argv)


def model_dir(args) -> Path:
    import dataclasses
    import tempfile

    from msa.checkpoint import write_checkpoint
    from workers.models import preset_config, tiny_model_dir

    if args.tiny:
        return tiny_model_dir()
    out = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="probe-compiles-", dir="/tmp"))
    if not (out / "config.json").is_file():
        config = dataclasses.replace(preset_config("m3-slice"), num_local_experts=args.num_experts,
                                     torch_dtype="bfloat16")
        write_checkpoint(config, out, seed=args.seed, dtype=torch.bfloat16, num_shards=4, device=args.device)
    return out


def serving_mix(vocab: int, seed: int) -> list[tuple[list[int], dict]]:
    """(prompt, SamplingParams fields) in arrival order: lengths around 1, 16, 128, chunk boundaries."""
    rng = random.Random(seed)
    lengths = [1, 5, 16, 17, 64, 100, 128, 129, 300, 1000, 1792, 2049, 4100, 33, 8, 640]
    extras = [{}, {"logprobs": 5}, {"n": 2}, {"repetition_penalty": 1.2}, {"temperature": 0.8, "seed": 7}]
    return [([rng.randrange(3, vocab) for _ in range(n)], extras[i % len(extras)]) for i, n in enumerate(lengths)]


def drive(engine, mix, log: CompileLog, max_tokens: int = 16) -> int:
    """Requests arrive one every 3 steps while the earlier ones decode; -> steps run."""
    from workers.request import SamplingParams

    pending, step = list(mix), 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            prompt, extra = pending.pop(0)
            params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **extra})
            engine.add_request(f"probe-{step}", prompt, params)
        log.step = step
        engine.step()
        step += 1
    return step


def main(argv=None) -> int:
    args = parse_args(argv)
    log = CompileLog()
    if args.device == "cuda":
        log.install()
    from workers.llm import LLM
    from workers.request import SamplingParams

    path = model_dir(args)
    t0 = time.perf_counter()
    llm = LLM(path, device=args.device, max_model_len=args.max_model_len, seed=args.seed)
    startup_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    log.phase = "warmup"  # what bench_serving_pd's warm-up does: a few short requests of the workload's shape
    rng = random.Random(args.seed + 1)
    llm.generate([{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(128)]} for _ in range(4)],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    log.phase = "serving"
    t0 = time.perf_counter()
    room = llm.engine.engine_config.max_model_len - 16  # each request's prompt plus its 16 tokens fits
    steps = drive(llm.engine, [(p, x) for p, x in serving_mix(vocab, args.seed) if len(p) <= room], log)
    serving_s = time.perf_counter() - t0
    llm.engine.shutdown()
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "model": str(path),
           "startup_s": startup_s, "serving_s": serving_s, "serving_steps": steps, "summary": log.summary(),
           "records": log.records}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / RESULT_NAME).write_text(json.dumps(doc, indent=2) + "\n")
    print(format_table(doc), flush=True)
    return 0


def format_table(doc: dict) -> str:
    lines = [f"Triton kernel variants built per phase ({doc['device']}; serving: {doc['serving_steps']} steps in "
             f"{doc['serving_s']:.1f} s)", "phase | variants | compiled (> 0.2 s) | seconds"]
    for phase in ("startup", "warmup", "serving"):
        s = doc["summary"].get(phase, {"variants": 0, "compiled": 0, "seconds": 0.0})
        lines.append(f"{phase} | {s['variants']} | {s['compiled']} | {s['seconds']:.1f}")
    for r in (r for r in doc["records"] if r["phase"] == "serving"):
        lines.append(f"  step {r['step']}: {r['kernel']} {r['seconds']:.2f} s  {r['specialization'][:160]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
