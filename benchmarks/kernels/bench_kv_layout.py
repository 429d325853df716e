"""The KV cache's layout inside a page, timed on one GPU: NHD (shipped) against HND, same kernels, same values.

The caches are [P, page_size, Hkv, D] (msa/kv_cache.py): one KV head's 128 key rows of a page are 256 B runs 1 KB
apart (NHD). Held as [P, Hkv, page_size, D] in memory (HND, FlashInfer's other layout) and passed as the same
[P, page_size, Hkv, D] view, a head's page is one contiguous 32 KB run: fewer DRAM rows opened per block read. Every
attention kernel takes the caches' strides, so the shipped code runs on both without a change; this times the
decode kernel (sparse at B = 1 / 16 / 64, dense at B = 16; CUDA graph of many calls, bench_decode.py's method) and
the prompt-row kernels (block-major split and token-major, events of one call, bench_prefill.py's method) on both
layouts in alternating rounds, and checks the outputs equal bit for bit. Adopting HND would change where the
pool is allocated and the paths that assume a contiguous page or slot (the torch write reference, whole-page
gathers; docs/benchmarks.md P17 lists them); this measures whether that is worth it first.

  PYTHONPATH=$PWD python3 benchmarks/kernels/bench_kv_layout.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def head_major(x):
    """The same values as x [P, ps, Hkv, D], held as [P, Hkv, ps, D] in memory (returned as the [P, ps, Hkv, D]
    view)."""
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def decode_rows(batch: int, rounds: int, gen, dense: bool = False) -> dict:
    import torch

    import bench_decode as bd
    from kernels import attention

    lens = bd.lengths(batch, 8700, gen)
    pages = sum(-(-n // bd.PS) for n in lens)
    read = sum(n if dense else min(n, bd.TOPK * bd.PS) for n in lens) * bd.HKV * bd.D * 4
    sets = max(1, min(64, math.ceil(4 * bd.L2_BYTES / read)))
    pool = max(pages, 4096)
    kc = torch.randn(pool, bd.PS, bd.HKV, bd.D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(pool, bd.PS, bd.HKV, bd.D, device="cuda", dtype=torch.bfloat16)
    layouts = {"nhd": (kc, vc), "hnd": (head_major(kc), head_major(vc))}
    tables = bd.page_sets(sets, lens, pool, gen)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, bd.HQ, bd.D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    sels = [None if dense else bd.random_selection(batch, lens, gen) for _ in range(sets)]
    times, outs = {name: [] for name in layouts}, {}
    for _ in range(rounds):  # alternating: the lease's drift hits both alike
        for name, (k, v) in layouts.items():
            calls = [lambda i=i, k=k, v=v: attention.paged_decode_attention(qs[i], k, v, tables[i], rows, pos,
                                                                             bd.D ** -0.5, sels[i])
                     for i in range(sets)]
            outs[name] = calls[0]()
            times[name].append(bd.graph_time_us(calls))
    return {"op": f"{'dense' if dense else 'sparse'} decode", "shape": f"B={batch} L=8.7k",
            **{f"{n} us": round(statistics.median(t), 2) for n, t in times.items()},
            "equal": bool(torch.equal(outs["nhd"], outs["hnd"]))}


def prompt_rows(t: int, ctx: int, rounds: int) -> list[dict]:
    import torch

    import bench_prefill as bp
    from graph_timing import eager_event_ms

    c = bp.make_case(t, ctx, seed=3)
    sel = bp.run_index(c)
    layouts = {"nhd": (c["k"], c["v"]), "hnd": (head_major(c["k"]), head_major(c["v"]))}
    kernels = {"split": lambda: bp.run_split(c, sel), "token-major": lambda: bp.run_attn(c, sel)}
    times = {(n, k): [] for n in layouts for k in kernels}
    outs = {}
    for _ in range(rounds):
        for name, (kc, vc) in layouts.items():
            c["k"], c["v"] = kc, vc
            for kind, fn in kernels.items():
                outs[(name, kind)] = fn()
                times[(name, kind)].append(eager_event_ms(fn, 7, warmup=1) * 1e3)
    return [{"op": f"prefill {kind}", "shape": f"{t} x {ctx}",
             **{f"{n} us": round(statistics.median(times[(n, kind)]), 1) for n in layouts},
             "equal": bool(torch.equal(outs[("nhd", kind)], outs[("hnd", kind)]))} for kind in kernels]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="B = 16 / 64 decode and 2k x 8k prefill only")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    print("device", torch.cuda.get_device_name(), flush=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    for batch in ((16, 64) if args.quick else (1, 16, 64)):
        results.append(decode_rows(batch, args.rounds, gen))
        print(json.dumps(results[-1]), flush=True)
    results.append(decode_rows(16, args.rounds, gen, dense=True))
    print(json.dumps(results[-1]), flush=True)
    for t, ctx in (((2048, 8192),) if args.quick else ((2048, 8192), (8192, 8192), (2048, 32768))):
        results += prompt_rows(t, ctx, args.rounds)
        print(json.dumps(results[-2:]), flush=True)
        torch.cuda.empty_cache()
    print("\nop | shape | NHD us | HND us | HND / NHD | outputs equal")
    for r in results:
        print(f"{r['op']} | {r['shape']} | {r['nhd us']} | {r['hnd us']} | {r['hnd us'] / r['nhd us']:.3f} | "
              f"{r['equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
