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
