"""Python's garbage collector in an engine replica: its pauses recorded, and the loaded heap frozen out of them.

A collection of the oldest generation walks every object the process tracks (Ray's, Serve's, torch's, the
model's modules and their parameters' wrappers), on whichever thread's allocation triggered it, holding the GIL:
the engine's step thread waits for it mid-forward. On the H200 the Serve replica had 10-92 ms decode steps a few
times per phase that the same engine in-process never had (docs/benchmarks.md S2). `freeze_loaded_heap` moves
every object alive after the load into the permanent generation, which collections skip (vLLM freezes its heap
after startup the same way); what serving allocates is still collected. `M3SERVE_GC_FREEZE=0` leaves the
collector as Python sets it. `GcPauses` times every collection (a `gc.callbacks` hook) for the replica's debug
timeline, so a slow step can be matched with a pause.
"""
from __future__ import annotations

import collections
import gc
import os
import time

FREEZE_ENV = "M3SERVE_GC_FREEZE"


def freeze_loaded_heap() -> bool:
    """Collect once, then freeze what is left (unless `M3SERVE_GC_FREEZE=0`); True when frozen."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    return True


class GcPauses:
    """A bounded ring of this process's collections: (wall start time, seconds, generation, objects collected)."""

    def __init__(self, size: int = 4096) -> None:
        self._ring: collections.deque[tuple[float, float, int, int]] = collections.deque(maxlen=size)
        self._started: tuple[float, float] | None = None

    def __call__(self, phase: str, info: dict) -> None:
        # Called by the collector with the GIL held, so collections never overlap: one pending start suffices.
        if phase == "start":
            self._started = (time.time(), time.perf_counter())
        elif self._started is not None:
            wall, t0 = self._started
            self._started = None
            self._ring.append((wall, time.perf_counter() - t0, int(info.get("generation", -1)),
                               int(info.get("collected", 0))))

    def install(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def since(self, wall_time: float) -> list[tuple[float, float, int, int]]:
        return [p for p in list(self._ring) if p[0] >= wall_time]


__all__ = ["FREEZE_ENV", "GcPauses", "freeze_loaded_heap"]
