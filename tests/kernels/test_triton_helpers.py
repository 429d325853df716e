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
