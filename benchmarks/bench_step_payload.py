"""Bytes a decode step ships to each shard: the pickled `StepBatch`, with per-sequence deltas (what the engine
sends) and with every scheduled sequence's whole page table in its chunk and, for a row with a repetition penalty,
its whole prompt and output token ids in its row (what it sent before workers/batch_delta.py).

A pure `EngineCore` (no model: a fake executor samples token 7) prefills B requests of a given context length,
then decodes; each decode step's batch is pickled both ways (`pickle.HIGHEST_PROTOCOL`, as
`WorkerGroup.execute` does), and resolved on a shard-side mirror (`resolve_batch`: the runner's added host work).
Page size 128 (the m3 preset's). CPU only, a few seconds per context.

  PYTHONPATH=$PWD python benchmarks/bench_step_payload.py                # B = 16, 8k and 128k-token contexts
  PYTHONPATH=$PWD python benchmarks/bench_step_payload.py --batch 64 --contexts 32768 --repetition-penalty 1.1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import random
import statistics
import time

from msa.metadata import ChunkSpec
from workers.config import EngineConfig
from workers.batch import penalty_token_ids, resolve_batch
from workers.batch_delta import SeqMirror
from workers.core import EngineCore
from workers.request import SamplingParams
from workers.runner import StepResult

PAGE_SIZE = 128


def without_deltas(core: EngineCore, batch):
    """The batch as it went before deltas: every chunk with its sequence's whole page table, every penalty row
    with its token ids (what `resolve_batch` gives the shard back)."""
    chunks = [ChunkSpec(core.pages.page_table(sid), c.start, c.num_tokens, c.is_decode, c.all_logits)
              for c, sid in zip(batch.chunks, batch.seq_delta.seq_ids)]
    seqs = {q.seq_id: q for r in core.scheduler.requests.values() for q in r.seqs}
    rows = []
    for row in batch.rows:
        needs_prompt, needs_output = penalty_token_ids(row.params)
        seq = seqs[row.seq_id]
        rows.append(dataclasses.replace(row, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens] if needs_prompt
                                        else [], output_token_ids=seq.output_token_ids if needs_output else []))
    return dataclasses.replace(batch, chunks=chunks, rows=rows, seq_delta=None)


def dumps(batch) -> tuple[int, float]:
    t = time.perf_counter()
    data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data), time.perf_counter() - t


def run(batch_size: int, context: int, decode_steps: int, repetition_penalty: float) -> dict:
    pages_per_seq = -(-(context + decode_steps) // PAGE_SIZE)
    cfg = EngineConfig(max_model_len=context + decode_steps + 1, max_num_seqs=batch_size,
                       max_num_batched_tokens=min(batch_size * context, 65536),
                       num_pages=batch_size * pages_per_seq + 1, enable_prefix_caching=False,
                       admission_watermark=0.0)
    core = EngineCore(cfg, num_pages=cfg.num_pages, page_size=PAGE_SIZE, vocab_size=1000)
    rng = random.Random(0)
    for i in range(batch_size):
        # contexts staggered by a few tokens, so the rows cross page boundaries on different steps
        core.add_request(f"r{i}", [rng.randrange(3, 1000) for _ in range(context - 8 * i)],
                         SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True,
                                        repetition_penalty=repetition_penalty))
    after, before, t_after, t_before, t_resolve = [], [], [], [], []
    mirror = SeqMirror()  # the shard's side: every batch is resolved, in order, as a runner does
    while True:
        batch = core.schedule()
        if batch is None:
            break
        t = time.perf_counter()
        resolve_batch(batch, mirror)
        resolve_s = time.perf_counter() - t
        if all(c.is_decode for c in batch.chunks) and len(batch.chunks) == batch_size:
            t_resolve.append(resolve_s)
            n, t = dumps(batch)
            after.append(n)
            t_after.append(t)
            n, t = dumps(without_deltas(core, batch))
            before.append(n)
            t_before.append(t)
        core.update(StepResult(token_ids=[7] * len(batch.rows), logprobs=[None] * len(batch.rows),
                               forward_time=0.0, sample_time=0.0))
    return {"batch": batch_size, "context": context, "repetition_penalty": repetition_penalty,
            "decode_steps": len(after),
            "bytes_before": statistics.mean(before), "bytes_after": statistics.mean(after),
            "bytes_after_max": max(after), "dumps_us_before": statistics.median(t_before) * 1e6,
            "dumps_us_after": statistics.median(t_after) * 1e6, "resolve_us": statistics.median(t_resolve) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072])
    p.add_argument("--decode-steps", type=int, default=256, help="measured decode steps (two pages' worth)")
    p.add_argument("--repetition-penalty", type=float, nargs="+", default=[1.0],
                   help="every request's (1.0: none; else each row's sampler reads its prompt and output ids)")
    p.add_argument("--out", default=None, help="result JSON")
    args = p.parse_args()
    rows = [run(args.batch, c, args.decode_steps, rp) for rp in args.repetition_penalty for c in args.contexts]
    print(f"{'B':>4} {'context':>8} {'rep pen':>7} {'steps':>6} {'bytes before':>13} {'bytes after':>12} "
          f"{'max after':>10} {'dumps us before':>16} {'dumps us after':>15} {'resolve us':>11}")
    for r in rows:
        print(f"{r['batch']:>4} {r['context']:>8} {r['repetition_penalty']:>7} {r['decode_steps']:>6} "
              f"{r['bytes_before']:>13,.0f} "
              f"{r['bytes_after']:>12,.0f} {r['bytes_after_max']:>10,} {r['dumps_us_before']:>16.1f} "
              f"{r['dumps_us_after']:>15.1f} {r['resolve_us']:>11.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
