"""Sparse decode attention over a grid of launch settings: merge kernel or folded merge, split count, warps.

bench_decode.py sweeps only around its best variant; this times the whole grid at B = 1 and 16 (L = 8,700, its
inputs and method: one CUDA graph of many calls over rotating inputs, L2 cold per call), each setting twice, the
lower kept, with its relative error against the fp32 reference. docs/benchmarks.md "Sparse decode sweep".

  PYTHONPATH=$PWD python3 benchmarks/kernels/sweep_decode_attn.py --out /tmp/sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402

from kernels import attention  # noqa: E402

GRID = {  # batch -> (fold_merge, num_splits, num_warps); (None, None, 4) = the shipped default
    1: [(fold, s, w) for fold in (False, True) for s in (2, 4, 8, 16) for w in (4, 8)],
    16: [(True, s, w) for s in (2, 3, 4, 6, 8) for w in (4, 8)] + [(False, s, 4) for s in (4, 8)],
}


def sweep(batch: int, settings: list, gen: torch.Generator) -> list[dict]:
    lens = bd.lengths(batch, 8700, gen)
    read = sum(min(n, bd.TOPK * bd.PS) for n in lens) * bd.HKV * bd.D * 4
    num_sets = max(1, min(64, -(-4 * bd.L2_BYTES // read)))
    pool = max(sum(-(-n // bd.PS) for n in lens), 4096)
    kc = torch.randn(pool, bd.PS, bd.HKV, bd.D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = bd.page_sets(num_sets, lens, pool, gen)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, bd.HQ, bd.D, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
    sels = [bd.random_selection(batch, lens, gen) for _ in range(num_sets)]
    scale = bd.D ** -0.5
    want = attention.paged_attention_ref(qs[0], kc, vc, tables[0], rows, pos, scale, sels[0])
    out = []
    for fold, splits, warps in [(None, None, 4)] + settings:
        attention.ATTN_LAUNCH.update(num_warps=warps)

        def run(i, fold=fold, splits=splits):
            return attention.paged_decode_attention(qs[i], kc, vc, tables[i], rows, pos, scale, sels[i],
                                                    num_splits=splits, fold_merge=fold)
        entry = dict(B=batch, fold=fold, splits=splits, warps=warps)
        try:
            got = run(0)
            entry["rel"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
            entry["us"] = min(bd.graph_time_us([lambda i=i: run(i) for i in range(num_sets)]) for _ in range(2))
        except Exception as e:  # keep the other settings' numbers
            entry["error"] = repr(e)[:200]
        finally:
            attention.ATTN_LAUNCH.update(num_warps=4)
        out.append(entry)
        print(entry, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [e for batch, settings in GRID.items() for e in sweep(batch, settings, gen)]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print("\nB  fold   splits warps  us      rel err")
    for r in rows:
        us = f"{r['us']:.2f}" if "us" in r else r["error"]
        print(f"{r['B']:<3}{str(r['fold']):<7}{str(r['splits']):<7}{r['warps']:<7}{us:<8}{r.get('rel', 0):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
