"""Test and drill hooks on an engine, through its public seams (DESIGN.md section 10).

Production code never calls these; tests call them directly, and the test-only deployments of
`deploy/testing.py` reach them through their engine server. Each works on an `Engine` and a `DPEngine` alike.
"""
from __future__ import annotations

from workers.engine_api import EngineAPI

HOLD_SEQ_ID = -1  # the page manager owner of the pages `hold_pages` takes


def hold_pages(engine: EngineAPI, num_pages: int) -> int:
    """Take `num_pages` free pages out of the engine's pools (a full decode replica), filling its cores in
    order; 0 gives them back. Returns how many are held; ValueError when fewer are free."""
    for core in engine.cores:
        core.pages.free(HOLD_SEQ_ID)
    free = [core.pages.num_free_pages for core in engine.cores]
    if num_pages > sum(free):
        raise ValueError(f"num_pages: only {sum(free)} pages are free")
    left = num_pages
    for core, n in zip(engine.cores, free):
        take = min(left, n)
        if take:
            core.pages.admit(HOLD_SEQ_ID)
            ok = core.pages.allocate(HOLD_SEQ_ID, take * core.pages.page_size)
            assert ok, "the pages were free"
        left -= take
    return num_pages


def set_transfer_faults(engine: EngineAPI, faults: dict[str, str]) -> None:
    """Break the KV transfers of these ids (`workers.kv.faults.FaultyChannel` kinds) on a prefill engine's
    shards; {} clears."""
    if engine.role != "prefill":
        raise ValueError(f"faults: injected on the sending (prefill) side; this engine is {engine.role}")
    for agent in engine.agents:
        agent.set_faults(faults)
