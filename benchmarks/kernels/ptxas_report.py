"""Registers, spills, shared memory and barriers of the heavy Triton kernels at M3 shapes, compiled for sm_90a on
any machine.

No GPU: Triton compiles to PTX for a named target and its bundled `ptxas -v` reports what each program will hold,
so a kernel change can be checked for registers, spills and shared memory (programs an SM) on the dev machine
before device time is spent on it. The arguments carry the 16-divisibility the JIT finds on the GPU (without it
the loads are not vectorised and the report describes a kernel that never runs); the B = 1 decode kernel then
reads as session 19's ncu read it on the H200 (docs/benchmarks.md P14). Numbers are per thread of one program;
"spill" is ptxas's static count of spill-store bytes, not a measured rate; "bar" counts `BAR.SYNC` in the SASS
(Triton's cuobjdump). `--sequence` prints each variant's SASS as a run-length list of its loads, stores, barriers,
MMAs and exp2s: a global load whose value goes through shared memory (a layout conversion: STS, BAR, LDS) in the
same loop iteration makes every iteration wait its round trip (docs/benchmarks.md P15 found two that way).

  PYTHONPATH=$PWD python3 benchmarks/kernels/ptxas_report.py            # every kernel and variant below
  PYTHONPATH=$PWD python3 benchmarks/kernels/ptxas_report.py --only merge --sequence
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: the interpreter has no PTX
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: kernels/

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kernels import attention, index_topk, prefill_sparse_split as split  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)
BF16_PTRS = {"q_ptr", "kc_ptr", "vc_ptr", "o_ptr"}  # bf16 tensors; other pointers int32 or fp32
FP32_PTRS = {"pl_ptr", "plse_ptr", "sc_ptr"}
_PREFILL = dict(G=16, D=128, PS=128, DOT_FP32=False, MASK_BRANCH=True, EVICT_FIRST=True)
_DECODE = dict(G=16, BLOCK_G=16, D=128, PS=128, TOPK=16, BLOCK_TOPK=16, SPARSE=True, ONE_SPLIT=False,
               DOT_FP32=False, PAGE_IDS=False, PDL=False)


def _variants() -> dict[str, list[tuple[str, object, dict, dict]]]:
    """group -> [(label, kernel, constexprs, launch options)] at the shipped defaults and a few alternatives."""
    fused = dict(_PREFILL, HKV=4, TOPK=16, CHUNK=1024, BLOCK_N=128, SPLIT=True)
    plain = dict(_PREFILL, BLOCK_N=128, PAIRS_PER_ROW=64)
    decode = dict(_DECODE, SWAP=False)
    return {
        "split": [
            ("fused with the split (fuse_split; 4 warps, SUB 4)", split._fused_kernel, dict(fused, SUB=4),
             dict(num_warps=4, num_stages=2)),
            ("fused with the split, 8 warps", split._fused_kernel, dict(fused, SUB=4), dict(num_warps=8, num_stages=2)),
            ("fused with the split, SUB 2", split._fused_kernel, dict(fused, SUB=2), dict(num_warps=4, num_stages=2)),
            ("fused, the work list only (the default)", split._fused_kernel, dict(fused, SUB=4, SPLIT=False),
             dict(num_warps=4, num_stages=2)),
            ("split launch, default (after the work list)", split._split_kernel, dict(plain, SUB=4), dict(num_warps=4, num_stages=2)),
            ("unfused split, 8 warps", split._split_kernel, dict(plain, SUB=4), dict(num_warps=8, num_stages=2)),
        ],
        "decode": [
            ("sparse, one tile a program (B = 1)", attention._decode_attn_kernel,
             dict(decode, BLOCK_N=128, PRELOAD=True, FOLD_MERGE=False, BLOCK_S=16), dict(num_warps=4, num_stages=3)),
            ("sparse, walking 64-key tiles, folded merge (B = 16)", attention._decode_attn_kernel,
             dict(decode, BLOCK_N=64, PRELOAD=True, FOLD_MERGE=True, BLOCK_S=4), dict(num_warps=4, num_stages=3)),
            ("sparse, swapped products (B = 16)", attention._decode_attn_kernel,
             dict(decode, BLOCK_N=64, PRELOAD=True, FOLD_MERGE=True, BLOCK_S=4, SWAP=True),
             dict(num_warps=4, num_stages=3)),
        ],
        # one or two warps a program (sweep_decode_attn.py --grid warps): whole rows a warp, no cross-warp softmax
        "decode_warps": [
            (f"sparse, {w} warp(s), {bn}-key tiles, {st} stages (B = 16)", attention._decode_attn_kernel,
             dict(decode, BLOCK_N=bn, PRELOAD=True, FOLD_MERGE=True, BLOCK_S=4), dict(num_warps=w, num_stages=st))
            for w, bn, st in ((1, 64, 2), (1, 32, 3), (2, 32, 3))
        ],
        "merge": [
            ("sparse prefill merge (a row's 16 partials)", split._merge_kernel,
             dict(G=16, D=128, HKV=4, TOPK=16, BLOCK_TOPK=16), dict(num_warps=4)),
            ("decode merge kernel (B = 1, 16 splits)", attention._merge_kernel, dict(D=128, BLOCK_S=16, PDL=False),
             dict(num_warps=4)),
        ],
        # the decode indexer's block scores: the tile load sits behind a page-id load inside the loop, so it gets
        # one buffer at any num_stages (docs/benchmarks.md P18: loading ids or tiles differently did not pay)
        "index": [
            ("index block scores (the decode indexer)", index_topk._index_scores_kernel,
             dict(HI=4, DI=128, PS=128, BLOCK_H=16, DOT_FP32=False, FUSED=False, TOPK=16, BLOCK_NB=16, BLOCK_J=1,
                  BLOCK_K=16, HP=4, PDL=True), dict(num_warps=4, num_stages=3)),
        ],
        "select": [
            ("rank selection, 8.7k tokens (68 blocks)", index_topk._select_topk_kernel,
             dict(PS=128, TOPK=16, BLOCK_NB=128, BLOCK_K=16, HP=1, BLOCK_J=index_topk._rank_tiles(1, 128),
                  PAGES=False, PDL=True), dict(num_warps=4)),
        ],
    }


def _signature(kernel, consts: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "po_ptr":  # partial outputs: q's dtype in the prefill split, fp32 in decode
            sig[name] = "*fp32" if kernel in (attention._decode_attn_kernel, attention._merge_kernel) else "*bf16"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name in BF16_PTRS else "*fp32" if name in FP32_PTRS else "*i32"
        elif "scale" in name:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _divisible(kernel, consts: dict) -> dict:
    """The 16-divisibility the JIT would find on the GPU: every pointer (the caches and buffers are aligned) and
    every integer it specialises (strides, tile counts: multiples of 16 at M3 shapes, except the decode partials'
    per-split strides at fewer than 16 splits: lse stores only). Without these hints the loads are not vectorised
    and the report describes another kernel than the one that runs."""
    loose = {p.name for p in kernel.params if p.do_not_specialize}
    sig = _signature(kernel, consts)
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
            if sig[name].startswith("*") or (sig[name] == "i32" and name not in loose)}


_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# the SASS instructions --sequence shows: global loads / stores, shared-memory traffic, barriers, MMAs, exp2, atomics
_SEQUENCE = re.compile(r"\b(LDGSTS|LDG|STG|LDS|STS|LDSM|STSM|BAR\.SYNC|HGMMA|HMMA|MUFU\.EX2|ATOMG|RED)\b")


def report(kernel, consts: dict, options: dict) -> dict:
    """Compile `kernel` for sm_90a -> registers, spill-store bytes, stack bytes, shared memory, wgmma count,
    SASS barriers, and the SASS itself."""
    source = triton.compiler.ASTSource(kernel, _signature(kernel, consts), constexprs=consts,
                                       attrs=_divisible(kernel, consts))
    compiled = triton.compile(source, target=TARGET, options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx_path.write_text(ptx)
        done = subprocess.run([str(_BIN / "ptxas"), "-v", "--gpu-name", "sm_90a", str(ptx_path), "-o", str(cubin)],
                              capture_output=True, text=True, check=True)
        sass = subprocess.run([str(_BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    text = done.stderr

    def num(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "stack": num(r"(\d+) bytes stack frame"), "shared": int(compiled.metadata.shared),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "barriers": len(re.findall(r"BAR\.SYNC", sass)),
            "sass": sass}


def sequence(sass: str) -> str:
    """The SASS's loads, stores, barriers, MMAs and exp2s in program order, runs of one kind counted (LDGx8)."""
    runs: list[list] = []
    for op in _SEQUENCE.findall(sass):
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(op if n == 1 else f"{op}x{n}" for op, n in runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(_variants()), default=None)
    ap.add_argument("--sequence", action="store_true", help="also each variant's SASS loads / stores / barriers")
    args = ap.parse_args(argv)
    print(f"{'kernel':58} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem KB':>8} {'wgmma':>6} {'bar':>4}")
    for group, rows in _variants().items():
        if args.only and group != args.only:
            continue
        for label, kernel, consts, options in rows:
            r = report(kernel, consts, options)
            print(f"{label:58} {r['registers']:5} {r['spill_stores']:8} {r['stack']:8} {r['shared'] / 1024:8.1f} "
                  f"{r['wgmma']:6} {r['barriers']:4}", flush=True)
            if args.sequence:
                print(f"  {sequence(r['sass'])}\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
