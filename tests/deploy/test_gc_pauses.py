"""deploy/gc_pauses.py: every collection of the process is timed into the ring (for the replica's debug
timeline), and the loaded heap is frozen out of later collections unless M3SERVE_GC_FREEZE=0."""
from __future__ import annotations

import gc
import time

import pytest

from deploy.gc_pauses import FREEZE_ENV, GcPauses, freeze_loaded_heap


def test_each_collection_is_timed_into_the_ring():
    pauses = GcPauses(size=4).install()
    try:
        before = time.time()
        gc.collect()
        gc.collect(0)
        got = pauses.since(before)
        assert [p[2] for p in got][-2:] == [2, 0]
        assert all(p[0] >= before and p[1] >= 0.0 for p in got)
        for _ in range(6):
            gc.collect(0)
        assert len(pauses.since(0.0)) == 4  # bounded
        assert pauses.since(time.time() + 60) == []
    finally:
        pauses.remove()
    assert pauses not in gc.callbacks
    n = len(pauses.since(0.0))
    gc.collect()
    assert len(pauses.since(0.0)) == n  # removed: no more entries


@pytest.fixture
def unfreeze():
    yield
    gc.unfreeze()


def test_freeze_moves_the_loaded_heap_out_of_collections(monkeypatch, unfreeze):
    monkeypatch.setenv(FREEZE_ENV, "0")
    gc.unfreeze()
    assert freeze_loaded_heap() is False and gc.get_freeze_count() == 0
    monkeypatch.delenv(FREEZE_ENV)
    loaded = [[i] for i in range(1000)]  # containers: tracked by the collector
    assert all(gc.is_tracked(x) for x in loaded)
    assert freeze_loaded_heap() is True
    assert gc.get_freeze_count() >= len(loaded)  # in the permanent generation, which collections skip
    assert all(gc.is_tracked(x) for x in loaded)  # still alive and tracked, just not scanned
