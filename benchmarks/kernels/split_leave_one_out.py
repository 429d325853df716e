"""Where the block-major split's time goes: its kernel timed with one part of each sub-tile left out (GPU).

The split (kernels/prefill_sparse_split.py) runs at ~35% of the bf16 peak (docs/benchmarks.md P10-P12); its loop is
serial within a program (gather q -> QK -> softmax -> PV -> store). Session 19 placed the decode kernel's time by
leaving parts out with temporary switches (docs/benchmarks.md "Sparse decode, where the time goes"); this does the
same for the split without switches in the shipped kernel: it rewrites a copy of the module's source with a
`LOO` constexpr (bits below), imports the copy, and times its unfused `_split_kernel` over a work list built once.
A rewrite that no longer finds its anchor in the source stops with an error (the kernel changed: update the anchors).

LOO bits: 1 no query gather in the loop (sub-tile 0's rows reused), 2 no partial store (a row sum kept live),
4 no softmax (the logits go to the PV dot as they are), 8 no PV dot. Outputs are wrong under any bit: timing only.
Each variant's registers and shared memory are printed beside it, since leaving a part out also changes how many
programs fit an SM. Method: device time of one launch, CUDA events, the GPU kept busy (`torch.cuda._sleep`) while
the host issues it, median over alternating rounds.

  PYTHONPATH=$PWD python3 benchmarks/kernels/split_leave_one_out.py [--loo 0,1,2,4,12] [--cases 2048:8192,8192:8192]
  PYTHONPATH=$PWD python3 benchmarks/kernels/split_leave_one_out.py --offline --loo 0,1,2,3,4,12   # no GPU
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

_LOOP = '''    for s in range(0, n_here, SUB):
        ok_nn, pair_nn = _sub_pairs(perm_ptr, first, s + 2 * SUB, n_here, slot)
        pos_n, q_n = _sub_queries(q_ptr, pos_ptr, pair_n, ok_n, heads, d, q_st_n, q_st_h, PAIRS_PER_ROW,
                                  DOT_FP32)
        out, lse = _sub_tile(q, pos, k0, v0, k1, v1, key0, n, qk_scale_log2, BM, D, PS, BLOCK_N, DOT_FP32,
                             MASK_BRANCH)
        _store_partial(po_ptr, pl_ptr, pair, ok, out, lse, mm, d, G, D, EVICT_FIRST)
'''
_LOOP_LOO = '''    for s in range(0, n_here, SUB):
        ok_nn, pair_nn = _sub_pairs(perm_ptr, first, s + 2 * SUB, n_here, slot)
        if LOO & 1:
            pos_n, q_n = pos, q
        else:
            pos_n, q_n = _sub_queries(q_ptr, pos_ptr, pair_n, ok_n, heads, d, q_st_n, q_st_h, PAIRS_PER_ROW,
                                      DOT_FP32)
        if LOO & 12:
            p = tl.dot(q, tl.trans(k0)) * qk_scale_log2
            if not LOO & 4:
                p = tl.exp2(p - tl.max(p, axis=1)[:, None])
            out = p if LOO & 8 else tl.dot(p.to(v0.dtype), v0)
            lse = tl.sum(out, axis=1)
        else:
            out, lse = _sub_tile(q, pos, k0, v0, k1, v1, key0, n, qk_scale_log2, BM, D, PS, BLOCK_N, DOT_FP32,
                                 MASK_BRANCH)
        if LOO & 2:  # a store no row makes (the data decides it, so the compiler keeps the values)
            tl.store(pl_ptr + pid * BM + mm, lse + tl.sum(out, axis=1), mask=ok & (lse == 12345.0))
        else:
            _store_partial(po_ptr, pl_ptr, pair, ok, out, lse, mm, d, G, D, EVICT_FIRST)
'''
# (anchor, replacement): the LOO constexpr through the split kernel into its item, and the loop above
REWRITES = [
    ("                  MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr):\n    pid = tl.program_id(0)",
     "                  MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr, LOO: tl.constexpr = 0):\n"
     "    pid = tl.program_id(0)"),
    ("DOT_FP32,\n                    MASK_BRANCH, EVICT_FIRST)\n",
     "DOT_FP32,\n                    MASK_BRANCH, EVICT_FIRST, LOO)\n"),
    ("                MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr):\n    # program `pid`",
     "                MASK_BRANCH: tl.constexpr, EVICT_FIRST: tl.constexpr, LOO: tl.constexpr = 0):\n"
     "    # program `pid`"),
    (_LOOP, _LOOP_LOO),
]


def rewritten_source() -> str:
    """kernels/prefill_sparse_split.py with the LOO switches (ValueError when an anchor is gone)."""
    src = (ROOT / "kernels" / "prefill_sparse_split.py").read_text()
    for anchor, replacement in REWRITES:
        if src.count(anchor) != 1:
            raise ValueError(f"split_leave_one_out: anchor not found once in the split's source: {anchor[:60]!r}")
        src = src.replace(anchor, replacement)
    return src


def load_variant_module():
    """The rewritten module, imported from a file (triton.jit reads each kernel's source from its file)."""
    path = Path(tempfile.mkdtemp()) / "prefill_sparse_split_loo.py"
    path.write_text(rewritten_source())
    spec = importlib.util.spec_from_file_location("prefill_sparse_split_loo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offline(loos: list[int]) -> None:
    """Registers, spills and shared memory of each variant compiled for sm_90a here (no GPU; ptxas_report.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ptxas_report as pr

    mod = load_variant_module()
    launch = mod.SPLIT_LAUNCH
    consts = dict(pr._PREFILL, BLOCK_N=launch["block_n"], PAIRS_PER_ROW=64, SUB=launch["sub"])
    for loo in loos:
        r = pr.report(mod._split_kernel, dict(consts, LOO=loo),
                      dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"]))
        print(json.dumps({"LOO": loo, "registers": r["registers"], "spill": r["spill_stores"],
                          "shared KB": round(r["shared"] / 1024, 1), "barriers": r["barriers"]}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loo", default="0,1,2,4,12")
    ap.add_argument("--cases", default="2048:8192,8192:8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offline", action="store_true", help="registers / shared memory only, compiled here")
    args = ap.parse_args(argv)
    loos = [int(x) for x in args.loo.split(",")]
    if args.offline:
        offline(loos)
        return 0
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_prefill as bp

    mod = load_variant_module()
    for case in args.cases.split(","):
        t, ctx = (int(x) for x in case.split(":"))
        c = bp.make_case(t, ctx, seed=3)
        sel = bp.run_index(c)
        n = min(t, int(mod.SPLIT_LAUNCH["max_rows"]))  # one row slice, as the shipped call's first
        q, pos, k, v, table = c["q"][:n], c["pos"][:n], c["k"], c["v"], c["table"]
        hkv, topk, group, d = bp.HKV, bp.TOPK, bp.HQ // bp.HKV, bp.D
        work = mod.build_work_list(sel[:n], c["qsl"], 0, 1, table.shape[1], mod.SPLIT_LAUNCH["pairs"])
        po = torch.empty((n * hkv * topk * group, d), dtype=q.dtype, device="cuda")
        pl = torch.empty((n * hkv * topk * group,), dtype=torch.float32, device="cuda")

        def launch(loo):
            return mod._split_kernel[(work.num_items,)](
                work.items, q, k, v, table, pos, work.seg_start, work.prog_end, work.perm, po, pl, q.stride(0),
                q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                table.stride(0), work.pairs_per_prog, work.num_requests, work.width, d ** -0.5 * mod._LOG2E,
                G=group, SUB=mod.SPLIT_LAUNCH["sub"], D=d, PS=bp.PS, BLOCK_N=mod.SPLIT_LAUNCH["block_n"],
                PAIRS_PER_ROW=hkv * topk, DOT_FP32=False, MASK_BRANCH=True, EVICT_FIRST=True, LOO=loo,
                num_warps=mod.SPLIT_LAUNCH["num_warps"], num_stages=mod.SPLIT_LAUNCH["num_stages"])

        compiled = {loo: launch(loo) for loo in loos}  # the JIT's first launch returns the compiled kernel
        shape = {loo: (k.n_regs, k.metadata.shared) for loo, k in compiled.items()}
        times = {loo: [] for loo in loos}
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for loo in loos:
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(100_000)  # the GPU busy while the host issues: the events see the kernel
                    a.record()
                    launch(loo)
                    b.record()
                    b.synchronize()
                    times[loo].append(a.elapsed_time(b) * 1e3)
        print(json.dumps({"T": t, "ctx": ctx, "rows": n, "items": work.num_items,
                          "us": {loo: round(statistics.median(v), 1) for loo, v in times.items()},
                          "regs, smem bytes": shape}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
