"""Test-only deployments: the engine server and router with fault injection, holds and pauses, and an ingress
that says who it is (DESIGN.md §10).

Production wiring (`deploy.app.build_app`, the CLI, Helm) never binds these; tests build their apps with
`build_drill_app`, which is `deploy.app.wire_app` with `DrillEngineServer`, `DrillRouter` and `DrillIngress` in
place of `EngineServer`, `Router` and `Ingress`. The deployments keep their names, so handles find them as usual.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ray import serve
from ray.serve import Application

from deploy.app import wire_app
from deploy.ingress import Ingress
from deploy.pd import Phase
from deploy.router import Router
from deploy.server import EngineServer

# router-side faults (transfer faults live on prefill replicas): hold a request as it enters its DECODE phase
# (deploy/pd.py; on the first-token path, after the first token went out) for PAUSE_S (the client leaves
# meanwhile) or DELAY_S (the decode runs ahead unattended)
FAULT_KINDS = ("pause_before_decode", "delay_before_decode")
PAUSE_S = 120.0
DELAY_S = 0.5
HOLD_PREFILL_S = 5.0  # how long a held prefill waits before it starts (a prefill queued behind long ones)


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=10)
class DrillEngineServer(EngineServer.func_or_class):
    """An `EngineServer` whose transfers can be broken, whose prefills can be held and whose pool can be
    filled, by request id."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held_prefills: dict[str, str] = {}

    async def pid(self) -> int:
        """This replica's process id (a test kills it as `kill -9` would)."""
        import os

        return os.getpid()

    async def inject_transfer_faults(self, faults: dict[str, str]) -> None:
        """Break the KV transfers of these ids (FaultyChannel kinds); {} clears."""
        from workers.testing import set_transfer_faults

        await self._require_engine().call(lambda e: set_transfer_faults(e, faults))

    async def hold_prefills(self, holds: dict[str, str]) -> None:
        """{request id: "hold"} makes `prefill` of those ids wait `HOLD_PREFILL_S` before it starts; {} clears."""
        bad = {k: v for k, v in holds.items() if v != "hold"}
        if bad:
            raise ValueError(f"holds: unknown kinds {bad}; known ('hold',)")
        self._held_prefills = dict(holds)

    async def prefill(self, req, decode_group: str, transfer_id: str | None = None):
        if self._held_prefills.get(req.request_id) == "hold":  # a prefill that has not started yet
            await asyncio.sleep(HOLD_PREFILL_S)
        async for event in super().prefill(req, decode_group, transfer_id):
            yield event

    async def hold_pages(self, num_pages: int) -> int:
        """Take pages out of this replica's pool (0 gives them back)."""
        from workers.testing import hold_pages

        return await self._require_engine().call(lambda e: hold_pages(e, num_pages))


@serve.deployment(max_ongoing_requests=4096)
class DrillRouter(Router.func_or_class):
    """A `Router` that pauses chosen requests before their decode stream (through the handoff's `on_phase`
    seam), and whose retry switch and admission wait can be changed while it runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._faults: dict[str, str] = {}
        self._pd.on_phase = self._hold_before_decode

    async def pid(self) -> int:
        """This replica's process id (a test kills it as `kill -9` would)."""
        import os

        return os.getpid()

    async def inject_faults(self, faults: dict[str, str], retry_prefill: bool | None = None,
                            admit_wait_s: float | None = None) -> None:
        """Faults by request id (`FAULT_KINDS`), the retry switch and the admission wait."""
        bad = {k: v for k, v in faults.items() if v not in FAULT_KINDS}
        if bad:
            raise ValueError(f"faults: unknown kinds {bad}; known {FAULT_KINDS}")
        self._faults = dict(faults)
        changes = {k: v for k, v in (("retry_prefill", retry_prefill), ("admit_wait_s", admit_wait_s))
                   if v is not None}
        self._pd.config = dataclasses.replace(self._pd.config, **changes)

    async def _hold_before_decode(self, request_id: str, phase: Phase) -> None:
        fault = self._faults.get(request_id)
        if phase is Phase.DECODE and fault in FAULT_KINDS:
            await asyncio.sleep(PAUSE_S if fault == "pause_before_decode" else DELAY_S)


@serve.deployment(max_ongoing_requests=4096)
class DrillIngress(Ingress.func_or_class):
    """An `Ingress` (the FastAPI class Serve wrapped) that tells a handle caller its process id and how many
    engine streams it has open, so a test can kill the replica that carries streams."""

    async def pid(self, hold_s: float = 0.0) -> dict[str, int]:
        """`hold_s`: answer after that long, so that calls made together spread over the replicas (Serve sends a
        call to the replica with fewer calls in flight)."""
        import os

        await asyncio.sleep(hold_s)
        return {"pid": os.getpid(), "live": len(self._engines.live)}


def build_drill_app(args: dict[str, Any] | None = None) -> Application:
    """`build_app(args)` with the drill deployments in place of the engine servers, the router and the ingress."""
    return wire_app(args, engine_server=DrillEngineServer, router=DrillRouter, ingress=DrillIngress)
