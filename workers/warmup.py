"""Engine warm-up: a short synthetic workload at startup, so the kernel variants serving meets are built before
the first user's request waits for them.

Triton compiles a kernel anew for every set of constexprs, and several follow the step's shape: the decode kernels'
split count and programmatic-dependent-launch switch (how many decode rows an eager mixed step has), the top-k
width (the step's page-table width in powers of two), the sparse prefill kernel's token tile and its block-major
path (chunk rows and context), the MoE tiles (the step's token count). The profile step and the decode graph
capture meet only some of them; the rest compiled in the first minute of serving, a 0.2-2 s stall of every
request in the step each time (H200, benchmarks/probe_compiles.py; docs/benchmarks.md D6, D7: a 1.2 s step in
a Serve run). Here requests of many prompt lengths arrive while earlier ones decode, through the engine's own
`add_request` / `step`, so every path is the one serving takes. Afterwards the engine is as it was: no request,
every page free, the prefix cache empty, the counters and stats the warm-up moved back at zero.

Hand-written: the compile hooks Triton offers (a pre-compile `warmup` per kernel) would need every launcher's
argument list and constexpr rules repeated here; driving the engine keeps one source of truth.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from workers.request import SamplingParams

logger = logging.getLogger("m3serve.warmup")

ARRIVE_EVERY = 2  # steps between arrivals: each prompt's chunks meet a different number of decoding rows
MAX_TOKENS = 8  # decode steps per request: enough to overlap the next arrivals
LONGEST = 16384  # prompt tokens at most: longer contexts' variants compile on first use (their prefill takes s)
BURSTS = (3, 6, 12, 24)  # short prompts arriving at once, then a prompt chunk beside their decode rows


@dataclass
class WarmupReport:
    requests: int = 0
    steps: int = 0
    seconds: float = 0.0
    mixed_steps: int = 0  # steps with prompt and decode rows both


def warmup_arrivals(max_model_len: int, chunk: int, page_size: int, max_num_seqs: int = 256) -> list[list[int]]:
    """Prompt lengths, one list per arrival (every `ARRIVE_EVERY` steps): short ones (single rows, a page and a
    bit); tables of 2, 4, 8, ... pages up to `LONGEST` (each power of two of the top-k width); chunks of 700-3,000
    rows while the longest still decodes (wide tables beside short chunks: the block-major prefill path); one
    prompt whose last chunk is 700 rows after a full chunk, where it fits; then bursts of short prompts whose
    decode rows (3 to 24) share an eager step with a 1,000-token chunk (the decode kernels' split classes)."""
    room = min(max_model_len - MAX_TOKENS, LONGEST)
    singles = [1, 5, 17, page_size + 1, 100, 300]
    pages = 2
    while pages * page_size <= room:
        singles.append(pages * page_size - 3)
        pages *= 2
    singles += [700, 1500, 3000]
    if chunk + 700 <= room:
        singles.append(chunk + 700)
    arrivals = [[n] for n in singles if 1 <= n <= room]
    for k in BURSTS:
        if k < max_num_seqs:
            arrivals += [[17] * k, [min(1000, room)]]
    return arrivals


def warmup_lengths(max_model_len: int, chunk: int, page_size: int, max_num_seqs: int = 256) -> list[int]:
    """Every prompt length of the warm-up, in arrival order."""
    return [n for group in warmup_arrivals(max_model_len, chunk, page_size, max_num_seqs) for n in group]


def warm_up(engine, *, budget_s: float = 120.0, seed: int = 0) -> WarmupReport:
    """Drive the warm-up workload through `engine` (an idle unified Engine) and put it back as it was."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine")
    cfg = engine.engine_config
    pending = warmup_arrivals(cfg.max_model_len, cfg.max_num_batched_tokens, engine.page_size, cfg.max_num_seqs)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    report, t0 = WarmupReport(), time.perf_counter()
    try:
        while pending or engine.has_unfinished():
            if time.perf_counter() - t0 > budget_s:
                logger.warning("warm-up stopped after %.0f s (budget): %d arrivals not run", budget_s, len(pending))
                break
            if pending and report.steps % ARRIVE_EVERY == 0:
                for n in pending.pop(0):
                    prompt = [rng.randrange(3, vocab) for _ in range(n)]
                    try:
                        engine.validate_request(prompt, params)
                    except ValueError:  # more than this pool or model length takes: skip it
                        continue
                    engine.add_request(f"warmup-{report.requests}", prompt, params)
                    report.requests += 1
            engine.step()
            report.steps += 1
    finally:
        engine.abort_all()
        while engine.has_unfinished():
            engine.step()
        report.mixed_steps = sum(1 for s in engine.pop_step_stats() if s.num_prefill_tokens and s.num_decode_tokens)
        _forget(engine)
    report.seconds = time.perf_counter() - t0
    return report


def _forget(engine) -> None:
    """What the warm-up left behind: its requests' stats, prefix-cache pages and the cumulative counters."""
    engine.pop_request_stats()
    engine.pop_step_stats()
    for core in engine.cores:
        core.pages.reset_prefix_cache()
        core.pages.prefix_queries = core.pages.prefix_hits = 0
        core.scheduler.num_preemptions = 0


__all__ = ["WarmupReport", "warm_up", "warmup_arrivals", "warmup_lengths"]
