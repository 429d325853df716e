"""Decode kernel benchmark on one GPU, following ../shared/PERF.md.

CUDA-graph replay of many calls that rotate over independent input sets (L2 stays cold: each call reads pages
no recent call touched), random bf16 data, shuffled page tables, context lengths that are not multiples of the
page size, median of many replays. Each shape sweeps the split count and the launch options and reports the
best; every best configuration is checked against the torch reference in the same run.

  PYTHONPATH=$PWD python3 benchmarks/kernels/bench_decode.py --out /tmp/bench.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
import traceback

import torch

from kernels import attention, index_topk as itk, paged_kv

PS, HKV, HQ, D, HI, DI, TOPK = 128, 4, 64, 128, 4, 128, 16
HBM = 4.3e12  # bytes/s, measured device-to-device copy ceiling (PERF.md)
L2_BYTES = 60 * 2**20
PEER = {("index", 1, 8700): 14.8, ("index", 16, 8700): 25.5, ("index", 64, 8700): 54.3,
        ("index", 16, 131072): 155, ("index", 64, 131072): 513,
        ("sparse", 1, 8700): 12.2, ("sparse", 16, 8700): 33.9, ("sparse", 64, 8700): 79.3}
TARGET = {("index", 1, 8700): 8, ("index", 16, 8700): 15, ("index", 64, 8700): 40, ("index", 16, 131072): 135,
          ("index", 64, 131072): 520, ("sparse", 1, 8700): 8, ("sparse", 16, 8700): 22, ("sparse", 64, 8700): 70}


def graph_time_us(calls, replays=30) -> float:
    """Median time of one call: all `calls` captured in one graph, replayed `replays` times."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def eager_time_us(calls, reps=20) -> float:
    """Median per-call time of launching `calls` eagerly (for paths that cannot be captured)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def lengths(batch, length, gen):
    # a little under `length`, never a multiple of the page size
    out = []
    for x in torch.randint(0, 64, (batch,), generator=gen).tolist():
        n = length - x
        out.append(n - 1 if n % PS == 0 else n)
    return out


def page_sets(num_sets, lens, pool_pages, gen):
    """num_sets page tables [B, max_pages] int32, each a fresh shuffle of the pool (distinct pages per call)."""
    need = sum(-(-n // PS) for n in lens)
    maxp = max(-(-n // PS) for n in lens)
    sets = []
    for _ in range(num_sets):
        perm = torch.randperm(pool_pages, generator=gen)[:need]
        table = torch.zeros(len(lens), maxp, dtype=torch.int32)
        used = 0
        for r, n in enumerate(lens):
            k = -(-n // PS)
            table[r, :k] = perm[used:used + k].to(torch.int32)
            used += k
        sets.append(table.cuda())
    return sets


def bench_index(batch, length, gen, log):
    lens = lengths(batch, length, gen)
    pages_per_call = sum(-(-n // PS) for n in lens)
    call_bytes = sum(lens) * DI * 2
    num_sets = max(1, min(64, math.ceil(4 * L2_BYTES / call_bytes)))
    pool = max(pages_per_call, 8192)
    cache = torch.randn(pool, PS, DI, device="cuda", dtype=torch.bfloat16)
    tables = page_sets(num_sets, lens, pool, gen)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    row_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, HI, DI, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
    maxp = tables[0].shape[1]
    base = itk.default_kv_splits(batch, maxp, torch.device("cuda"))
    results = []
    for splits, (warps, stages), topk_warps in itertools.product(sorted({max(1, base // 2), base, base * 2}),
                                                                 [(4, 2), (4, 3), (4, 4)], [1, 2, 4]):
        itk.TOPK_LAUNCH.update(num_warps=topk_warps)
        itk.SCORE_LAUNCH.update(num_warps=warps, num_stages=stages)
        calls = [lambda i=i: itk.index_topk(qs[i], cache, tables[i], row_seq, pos, TOPK, 1, num_kv_splits=splits,
                                            fused=False) for i in range(num_sets)]
        try:
            us = graph_time_us(calls)
        except Exception as e:  # a launch option the chip cannot take (shared memory): record and go on
            log.append({"op": "index", "B": batch, "L": length, "splits": splits, "warps": warps,
                        "stages": stages, "topk_warps": topk_warps, "error": repr(e)[:200]})
            continue
        results.append((us, splits, warps, stages, topk_warps))
        log.append({"op": "index", "B": batch, "L": length, "splits": splits, "warps": warps, "stages": stages,
                    "topk_warps": topk_warps, "us": us})
    us, splits, warps, stages, topk_warps = min(results)
    itk.SCORE_LAUNCH.update(num_warps=warps, num_stages=stages)
    itk.TOPK_LAUNCH.update(num_warps=topk_warps)
    # the two launches apart: where the time goes
    scores = [torch.empty(batch, HI, maxp, device="cuda") for _ in range(num_sets)]
    outs = [torch.empty(batch, HI, TOPK, device="cuda", dtype=torch.int32) for _ in range(num_sets)]
    score_us = graph_time_us([lambda i=i: itk.index_block_scores(qs[i], cache, tables[i], row_seq, pos, scores[i],
                                                                 num_kv_splits=splits) for i in range(num_sets)])
    select_us = graph_time_us([lambda i=i: itk.select_topk(scores[i], pos, outs[i], TOPK, 1, PS)
                               for i in range(num_sets)])
    got = itk.index_topk(qs[0], cache, tables[0], row_seq, pos, TOPK, 1, num_kv_splits=splits)
    want = itk.index_topk_ref(qs[0], cache, tables[0], row_seq, pos, TOPK, 1)
    ok = bool(torch.equal(got, want))
    itk.SCORE_LAUNCH.update(num_warps=4, num_stages=3)
    itk.TOPK_LAUNCH.update(num_warps=None)
    shipped = graph_time_us([lambda i=i: itk.index_topk(qs[i], cache, tables[i], row_seq, pos, TOPK, 1)
                             for i in range(num_sets)])
    two_launch = graph_time_us([lambda i=i: itk.index_topk(qs[i], cache, tables[i], row_seq, pos, TOPK, 1, fused=False)
                                for i in range(num_sets)])
    got = itk.index_topk(qs[1 % num_sets], cache, tables[1 % num_sets], row_seq, pos, TOPK, 1)
    ok = ok and bool(torch.equal(got, itk.index_topk_ref(qs[1 % num_sets], cache, tables[1 % num_sets], row_seq,
                                                         pos, TOPK, 1)))
    floor = batch * length * DI * 2 / HBM * 1e6
    return dict(op="index", B=batch, L=length, us=shipped, best_us=us, floor_us=floor, bytes=call_bytes,
                config=f"splits={splits} w={warps} st={stages} topk_w={topk_warps} "
                       f"[scores {score_us:.1f} + select {select_us:.1f}; shipped 2-launch {two_launch:.1f}]",
                default_splits=base, correct=ok, sets=num_sets, score_us=score_us, select_us=select_us)


def random_selection(batch, lens, gen):
    """[B, Hkv, TOPK] int32: TOPK distinct ascending visible blocks per KV head, own block included."""
    out = torch.full((batch, HKV, TOPK), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        nb = -(-n // PS)
        sc = torch.rand(HKV, nb, generator=gen)
        sc[:, nb - 1] = 2.0
        k = min(TOPK, nb)
        out[r, :, :k] = sc.topk(k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    return out.cuda()


def bench_attention(kind, batch, length, gen, log):
    lens = lengths(batch, length, gen)
    pages_per_call = sum(-(-n // PS) for n in lens)
    sparse = kind == "sparse"
    read = sum(min(n, TOPK * PS) if sparse else n for n in lens) * HKV * D * 2 * 2
    num_sets = max(1, min(64, math.ceil(4 * L2_BYTES / read)))
    pool = max(pages_per_call, 4096)
    kc = torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    tables = page_sets(num_sets, lens, pool, gen)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    row_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
    sels = [random_selection(batch, lens, gen) for _ in range(num_sets)] if sparse else [None] * num_sets
    max_blocks = TOPK if sparse else tables[0].shape[1]
    base = attention.default_attn_splits(batch, HKV, max_blocks, torch.device("cuda"))
    scale = D ** -0.5

    def run(i, splits):
        if sparse:
            return attention.sparse_attention(qs[i], kc, vc, tables[i], row_seq, pos, sels[i], scale,
                                              num_splits=splits)
        return attention.dense_attention(qs[i], kc, vc, tables[i], row_seq, pos, scale, num_splits=splits)

    results = []
    split_opts = {max(1, base // 2), base, min(max_blocks, base * 2), 1}
    configs = [(4, 2, 128), (4, 3, 128), (4, 2, 64), (4, 3, 64), (4, 4, 64), (8, 3, 64)]
    split_opts = sorted(split_opts | {2 * x for x in split_opts})
    for splits, (warps, stages, block_n) in itertools.product(split_opts, configs):
        attention.ATTN_LAUNCH.update(num_warps=warps, num_stages=stages, block_n=block_n)
        try:
            us = graph_time_us([lambda i=i: run(i, splits) for i in range(num_sets)])
        except Exception as e:
            log.append({"op": kind, "B": batch, "L": length, "splits": splits, "warps": warps, "stages": stages,
                        "block_n": block_n, "error": repr(e)[:200]})
            continue
        results.append((us, splits, warps, stages, block_n))
        log.append({"op": kind, "B": batch, "L": length, "splits": splits, "warps": warps, "stages": stages,
                    "block_n": block_n, "us": us})
    us, splits, warps, stages, block_n = min(results)
    attention.ATTN_LAUNCH.update(num_warps=warps, num_stages=stages, block_n=block_n)
    got = run(0, splits)
    want = attention.paged_attention_ref(qs[0], kc, vc, tables[0], row_seq, pos, scale, sels[0])
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    attention.ATTN_LAUNCH.update(num_warps=4, num_stages=3, block_n=128)
    shipped = graph_time_us([lambda i=i: run(i, None) for i in range(num_sets)])
    eff = min(length, TOPK * PS) if sparse else length
    floor = batch * HKV * eff * D * 2 * 2 / HBM * 1e6
    return dict(op=kind, B=batch, L=length, us=shipped, best_us=us, floor_us=floor, bytes=read,
                config=f"splits={splits} w={warps} st={stages} tile={block_n}", default_splits=base, correct=rel < 1e-2,
                rel_err=rel, sets=num_sets)


def bench_write(tokens, gen):
    pool = 4096
    caches = [torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(pool, PS, HKV, D, device="cuda", dtype=torch.bfloat16),
              torch.randn(pool, PS, DI, device="cuda", dtype=torch.bfloat16)]
    sets = 32
    k = [torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    v = [torch.randn(tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ik = [torch.randn(tokens, DI, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    slots = [torch.randperm(pool * PS, generator=gen)[:tokens].cuda() for _ in range(sets)]
    ours = graph_time_us([lambda i=i: paged_kv.write_kv(k[i], v[i], ik[i], slots[i], *caches) for i in range(sets)])
    ref = eager_time_us([lambda i=i: paged_kv.write_kv_ref(k[i], v[i], ik[i], slots[i], *caches)
                         for i in range(sets)])
    want = [c.clone() for c in caches]
    paged_kv.write_kv_ref(k[0], v[0], ik[0], slots[0], *want)
    paged_kv.write_kv(k[0], v[0], ik[0], slots[0], *caches)
    ok = all(torch.equal(a, b) for a, b in zip(caches, want))
    moved = tokens * (2 * HKV * D + DI) * 2 * 2
    return dict(op="write_kv", B=tokens, L=0, us=ours, floor_us=moved / HBM * 1e6, bytes=moved,
                config=f"torch reference path, eager (it syncs): {ref:.1f} us", correct=ok)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="one shape per op")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    log, rows = [], []
    t0 = time.time()
    index_shapes = [(1, 8700), (16, 8700), (64, 8700), (16, 131072), (64, 131072)]
    attn_shapes = [(1, 8700), (16, 8700), (64, 8700)]
    if args.quick:
        index_shapes, attn_shapes = index_shapes[:1], attn_shapes[:1]
    jobs = [(bench_index, (b, length, gen, log)) for b, length in index_shapes]
    jobs += [(bench_attention, (kind, b, length, gen, log)) for kind in ("sparse", "dense") for b, length in attn_shapes]
    jobs += [(bench_write, (t, gen)) for t in (1, 16, 64)]
    for fn, fn_args in jobs:
        try:
            rows.append(fn(*fn_args))
            print(rows[-1], flush=True)
        except Exception:  # keep the other shapes' numbers; the traceback goes to the log
            traceback.print_exc()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "sweep": log, "seconds": time.time() - t0}, f, indent=1)
    print("\nus = the launcher's shipped defaults; best = the best of the sweep (its config on the right)")
    print(f"\n{'op':9} {'B':>3} {'L':>7} {'us':>8} {'best':>6} {'floor':>7} {'target':>7} {'peer':>6} {'GB/s':>6} "
          f"{'floor/us':>8} ok  config")
    for r in rows:
        key = (r["op"], r["B"], r["L"])
        print(f"{r['op']:9} {r['B']:>3} {r['L']:>7} {r['us']:8.1f} {r.get('best_us', r['us']):6.1f} "
              f"{r['floor_us']:7.1f} "
              f"{TARGET.get(key, float('nan')):7.0f} {PEER.get(key, float('nan')):6.1f} "
              f"{r['bytes'] / r['us'] / 1e3:6.0f} {r['floor_us'] / r['us']:8.2f} {'y' if r['correct'] else 'N'}   "
              f"{r['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
