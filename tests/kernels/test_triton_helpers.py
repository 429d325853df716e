"""kernels/_triton.py helpers that CUDA graphs depend on."""
from __future__ import annotations

import torch

from kernels import _triton


def test_grown_arrival_counters_keep_the_old_buffer_alive(monkeypatch):
    """A decode graph captured with a counter buffer replays into that address; growing the buffer for a larger
    eager batch must not free it (the allocator would hand its memory to another tensor)."""
    monkeypatch.setattr(_triton, "_ARRIVAL_COUNTERS", {})
    monkeypatch.setattr(_triton, "_RETIRED_COUNTERS", [])
    cpu = torch.device("cpu")
    small = _triton.arrival_counters("t", 10, cpu, min_size=16)
    assert small.numel() == 16 and small.dtype == torch.int32 and not small.any()
    assert _triton.arrival_counters("t", 16, cpu, min_size=16) is small  # fits: the same buffer
    big = _triton.arrival_counters("t", 40, cpu, min_size=16)
    assert big.numel() == 40 and big is not small
    assert any(t is small for t in _triton._RETIRED_COUNTERS)
    assert _triton.arrival_counters("t", 8, cpu) is big  # the current buffer serves smaller requests


def test_pdl_launch_policy(monkeypatch):
    """Programmatic dependent launch: never on CPU (the interpreter), on a Hopper GPU up to each kernel kind's row
    limit, off before sm90 and when M3SERVE_PDL=0 or PDL["enabled"] is False."""
    from kernels import _triton

    assert _triton.pdl_launch(torch.device("cpu"), "attention", 1) == ({}, False)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (9, 0))
    monkeypatch.delenv("M3SERVE_PDL", raising=False)
    limit = _triton.PDL_MAX_ROWS["attention"]
    assert _triton.pdl_launch(gpu, "attention", limit) == ({"launch_pdl": True}, True)
    assert _triton.pdl_launch(gpu, "attention", limit + 1) == ({}, False)
    assert _triton.pdl_launch(gpu, "index", _triton.PDL_MAX_ROWS["index"])[1]
    monkeypatch.setenv("M3SERVE_PDL", "0")
    assert not _triton.pdl_launch(gpu, "attention", 1)[1]
    monkeypatch.setitem(_triton.PDL, "enabled", True)
    assert _triton.pdl_launch(gpu, "attention", 1)[1]
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (8, 0))
    assert not _triton.pdl_launch(gpu, "attention", 1)[1]


_KEY_PROBE = r"""
import torch, triton, triton.language as tl
from kernels._triton import CompiledLaunch

@triton.jit(do_not_specialize=["n"])
def k(x_ptr, y_ptr, n, stride, scale, BLOCK: tl.constexpr):
    pass

c = CompiledLaunch(k)
buf = torch.zeros(64, dtype=torch.float32)
def key(x=buf, n=5, stride=8, block=16, dtype=None, warps=4):
    y = buf if dtype is None else buf.to(dtype)
    return c._key((x, y, n, stride, 0.5), {"BLOCK": block}, {"num_warps": warps}, torch.device("cuda", 0))
base = key()
print(key(n=7) == base, key(n=2**31) != base, key(stride=16) != base, key(stride=1) != base,
      key(x=buf[1:]) != base, key(x=buf[4:]) == base, key(block=32) != base, key(dtype=torch.float16) != base,
      key(warps=8) != base)
"""


def test_compiled_launch_key_names_the_variant_the_jit_would_pick(tmp_path):
    """A direct launch reuses a compiled kernel only for arguments Triton would specialise alike: a
    do-not-specialise int may change within int32, any other int, a tensor's dtype or 16-byte alignment, a
    constexpr or a launch option changes the key. Compiled-kernel Triton (not the interpreter this folder runs),
    so in a fresh interpreter; the GPU test (test_prefill_gpu.py) checks the launches themselves."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    probe = tmp_path / "probe.py"  # triton.jit reads its kernel's source from a file
    probe.write_text(_KEY_PROBE)
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"] * 9, done.stdout


def test_ptxas_report_reads_compiled_kernels():
    """benchmarks/kernels/ptxas_report.py compiles for sm_90a without a GPU: every decode variant reports its
    registers and shared memory, and only the swapped products use wgmma (Hopper's MMA on 64+ rows)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, str(root / "benchmarks/kernels/ptxas_report.py"), "--only", "decode"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.rsplit(None, 6) for line in done.stdout.splitlines()[1:]]
    assert len(rows) == 3, done.stdout
    for label, regs, spill, stack, smem, wgmma, bars in rows:
        assert 0 < int(regs) <= 255 and float(smem) > 0 and int(bars) > 0, label
        assert (int(wgmma) > 0) == ("swapped" in label), label


def test_the_sparse_prefill_merge_issues_its_loads_without_barriers_between():
    """The merge's partial loads must not wait on one another (docs/benchmarks.md P15: a [G] lse broadcast through
    shared memory put two barriers after each partial's lse load, 16 dependent round trips a program). In the
    merge's SASS (ptxas_report.py --sequence, sm_90a, no GPU), from the first run of 16+ global loads to the last
    global load there is no barrier."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, str(root / "benchmarks/kernels/ptxas_report.py"), "--only", "merge",
                           "--sequence"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    ops = lines[lines.index(next(x for x in lines if x.startswith("sparse prefill merge"))) + 1].split()
    first = next(i for i, op in enumerate(ops) if op.startswith("LDGx") and int(op[4:]) >= 16)
    last = max(i for i, op in enumerate(ops) if op.startswith("LDG"))
    assert not [op for op in ops[first:last] if op.startswith("BAR")], ops


_LOO_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1] + "/benchmarks/kernels")
import ptxas_report as pr, split_leave_one_out as loo
from kernels import prefill_sparse_split as shipped
mod = loo.load_variant_module()
consts = dict(pr._PREFILL, BLOCK_N=128, PAIRS_PER_ROW=64, SUB=4)
opts = dict(num_warps=4, num_stages=2)
base = pr.report(shipped._split_kernel, consts, opts)
rows = [pr.report(mod._split_kernel, dict(consts, LOO=bits), opts) for bits in (0, 3)]
print(base["registers"], rows[0]["registers"], rows[1]["registers"], base["wgmma"], rows[0]["wgmma"])
"""


def test_split_leave_one_out_rewrites_the_shipped_kernel(tmp_path):
    """benchmarks/kernels/split_leave_one_out.py rewrites the shipped split's source: with no bit set its kernel
    compiles (sm_90a, no GPU) to what the shipped one does, and leaving the query gather and the store out frees
    registers. Fails when the split's source moves away from the script's anchors."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    probe = tmp_path / "probe.py"
    probe.write_text(_LOO_PROBE)
    done = subprocess.run([sys.executable, str(probe), str(root)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    base, same, fewer, wg_base, wg_same = (int(x) for x in done.stdout.split())
    assert same == base and wg_same == wg_base > 0
    assert fewer < base
