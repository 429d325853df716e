"""Sparse decode attention over a grid of launch settings: merge kernel or folded merge, split count, warps.

bench_decode.py sweeps only around its best variant; this times the whole grid at B = 1 and 16 (L = 8,700, its
inputs and method: one CUDA graph of many calls over rotating inputs, L2 cold per call), each setting twice, the
lower kept, with its relative error against the fp32 reference. docs/benchmarks.md "Sparse decode sweep".

  PYTHONPATH=$PWD python3 benchmarks/kernels/sweep_decode_attn.py --out /tmp/sweep.json
  PYTHONPATH=$PWD python3 benchmarks/kernels/sweep_decode_attn.py --grid tiles --empty   # tile sizes; bare cost
  PYTHONPATH=$PWD python3 benchmarks/kernels/sweep_decode_attn.py --grid warps           # 1-2 warps a program
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402

from kernels import _triton, attention  # noqa: E402

# block_n None: the launcher's tiles (block_n, or block_n_walk where a program walks several); a number: that tile
SHIPPED = dict(fold=None, splits=None, warps=4, block_n=None, stages=3, preload=None, pid=False, pdl=None)


def _grid(batch_settings: dict) -> dict:
    """batch -> settings, each the shipped one with the keys given changed"""
    return {b: [{**SHIPPED, **kw} for kw in kws] for b, kws in batch_settings.items()}


GRIDS = {  # name -> batch -> settings (SHIPPED's keys); each grid also times the shipped setting first
    "launch": _grid({
        1: [dict(fold=fold, splits=s, warps=w, block_n=128) for fold in (False, True) for s in (2, 4, 8, 16)
            for w in (4, 8)],
        16: [dict(fold=True, splits=s, warps=w, block_n=128) for s in (2, 3, 4, 6, 8) for w in (4, 8)]
        + [dict(fold=False, splits=s, block_n=128) for s in (4, 8)],
    }),
    # smaller tiles: more programs (and SMs) per row at B = 1, fewer bytes a program at 16
    "tiles": _grid({
        1: [dict(fold=False, splits=s, warps=w, block_n=bn) for bn, ss in ((64, (16, 32)), (32, (32, 64)))
            for s in ss for w in (2, 4)],
        16: [dict(fold=fold, splits=s, block_n=bn) for bn in (64, 32) for fold in (True, False) for s in (4, 8)],
    }),
    # B = 16: page ids up front (preload, or given: pid) so the loop's tile loads can be pipelined, in tiles small
    # enough that 2-3 programs' stages fit an SM's shared memory; PDL on and off
    "pipe": _grid({
        1: [dict(pid=True, pdl=pdl) for pdl in (True, False)],
        16: [dict(fold=fold, splits=s, block_n=bn, stages=st, preload=pre, pid=pid, pdl=pdl)
             for bn, st in ((128, 2), (64, 2), (64, 3), (64, 4), (32, 4)) for s in (4, 8) for fold in (True, False)
             for pre, pid in ((True, False), (True, True)) for pdl in (False,)]
        + [dict(fold=fold, pid=True, pdl=True) for fold in (True, False)],
    }),
    # one or two warps a program (session 22, offline SASS): with 4 warps the 16 heads' rows are split over the
    # warps along the keys, so each tile's row max and row sum cross warps through shared memory (~7 barriers a
    # tile at B = 16); one warp holds whole rows (no cross-warp reduction; its barriers are the stages' own), and
    # more programs fit an SM (1 warp, 64-key tiles,
    # 2 stages: 254 registers, 36 KB, no spill; 128-key tiles spill at 1 warp)
    "warps": _grid({
        1: [dict(fold=False, splits=s, warps=w, block_n=64, stages=st) for s in (16, 32) for w, st in ((1, 2), (2, 3))],
        16: [dict(fold=fold, splits=s, warps=w, block_n=bn, stages=st) for fold in (True, False) for s in (4, 8, 12)
             for w, bn, st in ((1, 64, 2), (1, 32, 3), (2, 32, 3))],
    }),
}


def sweep(batch: int, settings: list, gen: torch.Generator, empty: bool = False) -> list[dict]:
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
    if empty:  # no block selected: what is left is the launches, the id loads and the merge
        sels = [torch.full_like(x, -1) for x in sels]
    pids = [bd.page_ids(sel, t, rows) for sel, t in zip(sels, tables)]
    scale = bd.D ** -0.5
    want = None if empty else attention.paged_attention_ref(qs[0], kc, vc, tables[0], rows, pos, scale, sels[0])
    out = []
    pdl_rows, shipped = dict(_triton.PDL_MAX_ROWS), dict(attention.ATTN_LAUNCH)
    for cfg in [SHIPPED] + settings:
        attention.ATTN_LAUNCH.update(num_warps=cfg["warps"], num_stages=cfg["stages"])
        if cfg["block_n"] is not None:
            attention.ATTN_LAUNCH.update(block_n=cfg["block_n"], block_n_walk=cfg["block_n"])
        if cfg["pdl"] is not None:
            _triton.PDL_MAX_ROWS["attention"] = batch if cfg["pdl"] else 0

        def run(i, cfg=cfg):
            return attention.paged_decode_attention(qs[i], kc, vc, tables[i], rows, pos, scale, sels[i],
                                                    num_splits=cfg["splits"], fold_merge=cfg["fold"],
                                                    preload=cfg["preload"], page_ids=pids[i] if cfg["pid"] else None)
        entry = dict(B=batch, **cfg, empty=empty)
        try:
            got = run(0)
            if want is not None:
                entry["rel"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
            entry["us"] = min(bd.graph_time_us([lambda i=i: run(i) for i in range(num_sets)]) for _ in range(2))
        except Exception as e:  # keep the other settings' numbers
            entry["error"] = repr(e)[:200]
        finally:
            attention.ATTN_LAUNCH.clear()
            attention.ATTN_LAUNCH.update(shipped)
            _triton.PDL_MAX_ROWS.update(pdl_rows)
        out.append(entry)
        print(entry, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="launch")
    ap.add_argument("--empty", action="store_true", help="also time each setting with no block selected")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [e for batch, settings in GRIDS[args.grid].items() for e in sweep(batch, settings, gen)]
    if args.empty:
        rows += [e for batch, settings in GRIDS[args.grid].items() for e in sweep(batch, settings, gen, empty=True)]
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    keys = list(SHIPPED) + ["empty"]
    print("\nB   " + "".join(f"{k:<8}" for k in keys) + "us      rel err")
    for r in rows:
        us = f"{r['us']:.2f}" if "us" in r else r["error"]
        print(f"{r['B']:<4}" + "".join(f"{str(r[k]):<8}" for k in keys) + f"{us:<8}{r.get('rel', 0):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
