"""Host time of the block-major sparse prefill call and of its parts, on one GPU (docs/benchmarks.md P11, P15).

PERF.md's prefill method times one eager call between CUDA events, so at 2k prompt rows the host's time to issue
the call shows in the result. This prints the host microseconds per call (the queue kept busy by the calls before
it, one synchronise at the end) of the whole call (fused and unfused), its pieces and a few reference operations,
the default call against the same call with its buffers allocated per call (the path before the kept buffers: host
us, and events of one call in alternating rounds), then a cProfile of the default call. 2,048 new tokens after
6,144 cached (bench_prefill.py's 2k x 8k case). `--ncu-target`: one unfused call and nothing else, for
`ncu -k regex:"_split_kernel|_merge_kernel" -c 2` (docs/benchmarks.md P15 has the sections).

  PYTHONPATH=$PWD python3 benchmarks/kernels/prefill_host_probe.py
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
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


def allocate_per_call(on: bool) -> None:
    """The fused path with its work-list buffers and partials allocated on every call (on) or kept (off: shipped)."""
    if on:
        sp._kept_work_buffers = swl.work_buffers
        sp._kept_partials = lambda rows, d, dtype, dev: (torch.empty((rows, d), dtype=dtype, device=dev),
                                                         torch.empty((rows,), dtype=torch.float32, device=dev))
    else:
        sp._kept_work_buffers, sp._kept_partials = _KEPT


_KEPT = (sp._kept_work_buffers, sp._kept_partials)


def kept_against_allocated(c, sel, rounds: int = 3, reps: int = 7) -> dict:
    """Events of one call (PERF.md's single-call method) and host us, kept buffers against per-call allocations,
    in alternating rounds so the lease's drift hits both; outputs bitwise equal."""
    outs, times = {}, {"kept": [], "allocated": []}
    for arm in times:
        allocate_per_call(arm == "allocated")
        outs[arm] = bp.run_split(c, sel).clone()
    for _ in range(rounds):
        for arm in times:
            allocate_per_call(arm == "allocated")
            times[arm] += [bp.event_ms(lambda: bp.run_split(c, sel), 1) for _ in range(reps)]
    res = {f"events ms {arm}": round(statistics.median(v), 4) for arm, v in times.items()}
    for arm in times:
        allocate_per_call(arm == "allocated")
        res[f"host us {arm}"] = host_us(lambda: bp.run_split(c, sel))
    allocate_per_call(False)
    res["outputs equal"] = bool(torch.equal(outs["kept"], outs["allocated"]))
    return res


def main() -> int:
    c = bp.make_case(2048, 8192, seed=3)
    sel = bp.run_index(c)
    if "--ncu-target" in sys.argv:
        bp.run_split(c, sel, {"fused": False})
        torch.cuda.synchronize()
        return 0
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
        "call (default: work list fused, split launched)": host_us(lambda: bp.run_split(c, sel)),
        "call (split inside the fused kernel)": host_us(lambda: bp.run_split(c, sel, {"fuse_split": True})),
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
    print("kept buffers against per-call allocations", kept_against_allocated(c, sel))
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
