"""Host time of the block-major sparse prefill call and of its parts, on one GPU (docs/benchmarks.md P11).

PERF.md's prefill method times one eager call between CUDA events, so at 2k prompt rows the host's time to issue
the call shows in the result. This prints the host microseconds per call (the queue kept busy by the calls before
it, one synchronise at the end) of the whole call (fused and unfused), its pieces and a few reference operations,
then a cProfile of the default call. 2,048 new tokens after 6,144 cached (bench_prefill.py's 2k x 8k case).

  PYTHONPATH=$PWD python3 benchmarks/kernels/prefill_host_probe.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_prefill.py, beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: kernels/
import bench_prefill as bp  # noqa: E402
from kernels import prefill_sparse_split as sp  # noqa: E402
from kernels import sparse_work_list as swl  # noqa: E402


def host_us(fn) -> float:
    return round(bp.host_ms(fn, calls=300) * 1e3, 1)  # bench_prefill's host timing, in us


def main() -> int:
    c = bp.make_case(2048, 8192, seed=3)
    sel = bp.run_index(c)
    rows, group, width = c["t"], bp.HQ // bp.HKV, c["table"].shape[1]
    opts = sp.split_options(None, group, bp.PS, False)
    dev = c["q"].device
    work = sp.build_work_list(sel, c["qsl"], 0, 1, width, opts["pairs"])
    part_o = torch.empty((rows * bp.HKV * bp.TOPK * group, bp.D), dtype=c["q"].dtype, device=dev)
    part_lse = torch.empty((rows * bp.HKV * bp.TOPK * group,), dtype=torch.float32, device=dev)
    out = torch.empty_like(c["q"])
    x = torch.empty(10, device=dev)
    scale = bp.D ** -0.5
    res = {
        "call (default: fused)": host_us(lambda: bp.run_split(c, sel)),
        "call (unfused)": host_us(lambda: bp.run_split(c, sel, {"fused": False})),
        "fused_split alone": host_us(lambda: sp.fused_split(c["q"], c["k"], c["v"], c["table"], c["qsl"], c["pos"],
                                                            sel, 0, 1, scale, part_o, part_lse, opts)),
        "build_work_list (unfused)": host_us(lambda: sp.build_work_list(sel, c["qsl"], 0, 1, width, opts["pairs"])),
        "split_merge (unfused)": host_us(lambda: sp.split_merge(c["q"], c["k"], c["v"], c["table"], c["pos"], sel,
                                                                scale, work, out, part_o, part_lse, opts)),
        "a bare Triton launch": host_us(lambda: swl._scatter_kernel[(1,)](
            work.perm, work.perm, work.seg_start, work.prog_end, work.perm, work.items, 0, 0, 1, 2, BLOCK=1024,
            num_warps=4)),
        "six torch.empty": host_us(lambda: [torch.empty(1000, dtype=torch.int32, device=dev) for _ in range(6)]),
        "torch.add": host_us(lambda: torch.add(x, 1)),
    }
    print("host us per call", res)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        bp.run_split(c, sel)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
