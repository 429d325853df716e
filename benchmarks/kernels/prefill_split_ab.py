"""The block-major sparse prefill of this tree against another version of its module, on one GPU, same inputs.

A change to kernels/prefill_sparse_split.py is judged within one run (docs/benchmarks.md P16): the lent machines'
host speed moves one call's events by more than many changes do from lease to lease. This loads the other version
from a file (a copy of the module: `git show REV:kernels/prefill_sparse_split.py > FILE` on the dev machine, whose
history the device copy may lack) beside the shipped module and times both, plus any launch options of the shipped
one, on bench_prefill.py's cases: outputs against the old version (bitwise) and against the token-major kernel
(rel. error), events of one call (PERF.md's single-call method: the median of each round's median, the arms in
alternating rounds), host us to issue a call, and device us by kernel (torch profiler).

  git show a6a17fc:kernels/prefill_sparse_split.py > .gpu/old_split.py
  PYTHONPATH=$PWD python3 benchmarks/kernels/prefill_split_ab.py --old .gpu/old_split.py \
      [--old .gpu/another.py] [--launches '[{"fuse_split": true}]'] [--cases 2048:8192,2048:32768,8192:8192]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_module(path: str | Path, name: str = "kernels._prefill_split_old"):
    """The module in `path` as a module of its own (its kernels compile apart from the shipped ones)."""
    spec = importlib.util.spec_from_file_location(name, Path(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(arms: dict, cases: list[tuple[int, int]], rounds: int, reps: int) -> list[dict]:
    """arms: name -> (module, launch); the first is the baseline the others' outputs are compared with."""
    import torch

    import bench_prefill as bp
    from graph_timing import eager_event_ms

    def call(arm, c, sel):
        module, launch = arms[arm]
        return module.prefill_sparse_split(c["q"], c["k"], c["v"], c["table"], c["qsl"], c["pos"], bp.D ** -0.5,
                                           sel, num_requests=1, max_len=c["t"], launch=launch)

    base = next(iter(arms))
    rows = []
    for t, ctx in cases:
        c = bp.make_case(t, ctx, seed=3)
        sel = bp.run_index(c)
        ref, want = bp.run_attn(c, sel), call(base, c, sel)
        row = {"T": t, "ctx": ctx, "equal_to_" + base: {}, "rel_vs_token_major": {}, "events_ms": {},
               "host_us": {}, "kernels_us": {}}
        for arm in arms:
            got = call(arm, c, sel)
            row["equal_to_" + base][arm] = bool(torch.equal(got, want))
            row["rel_vs_token_major"][arm] = round(bp.rel(got, ref), 6)
        medians = {arm: [] for arm in arms}
        for _ in range(rounds):  # alternating: the lease's drift hits every arm alike
            for arm in arms:
                medians[arm].append(eager_event_ms(lambda: call(arm, c, sel), reps, warmup=1))
        for arm in arms:
            row["events_ms"][arm] = round(statistics.median(medians[arm]), 4)
            row["host_us"][arm] = round(bp.host_ms(lambda: call(arm, c, sel), calls=50) * 1e3, 1)
            row["kernels_us"][arm] = bp.kernel_times(lambda: call(arm, c, sel))
        print("row", json.dumps(row), flush=True)
        rows.append(row)
        c = sel = ref = want = None
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, action="append",
                    help="a copy of another version of kernels/prefill_sparse_split.py (again for more: each an arm "
                         "named by its file's stem; the first is the baseline)")
    ap.add_argument("--launches", default="[]", help="JSON list of launch dicts for the shipped module, beside")
    ap.add_argument("--cases", default="2048:8192,2048:32768,8192:8192", help="T:ctx,...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    from kernels import prefill_sparse_split as shipped

    arms = {"old" if i == 0 else Path(path).stem: (load_module(path, f"kernels._prefill_split_old{i}"), None)
            for i, path in enumerate(args.old)}
    arms["new"] = (shipped, None)
    arms.update({"new " + json.dumps(o): (shipped, o) for o in json.loads(args.launches)})
    cases = [tuple(int(x) for x in s.split(":")) for s in args.cases.split(",")]
    print("device", torch.cuda.get_device_name(), flush=True)
    rows = compare(arms, cases, args.rounds, args.reps)
    print("\nT x ctx | arm | equal to old | rel vs token-major | events ms | host us | device us (all kernels)")
    for r in rows:
        for arm in arms:
            print(f"{r['T']} x {r['ctx']} | {arm} | {r['equal_to_old'][arm]} | {r['rel_vs_token_major'][arm]} | "
                  f"{r['events_ms'][arm]} | {r['host_us'][arm]} | {round(sum(r['kernels_us'][arm].values()), 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
