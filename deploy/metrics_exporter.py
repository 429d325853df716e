"""An engine replica's metrics recorded in a process of their own: a small Ray actor beside each engine replica.

Why a process: recording is per value (Ray's histograms take no counts, so every step and every token gap is one
call into Ray's recorder, ~2.6 us, plus one into the replica's prometheus_client registry), and in the engine
replica's process that work holds the GIL its step thread needs. On the H200 a reporter tick's 7-60 ms of it
stalled 1.6 ms decode steps to 6-20 ms, and cutting it into slices with sleeps between them only spread the stall
over more steps (docs/benchmarks.md S5, S6). (vLLM V1 likewise records its metrics in its front-end process, not
in the engine core's.) So the replica's `EngineReporter` only pops the engine's stats into a `TickBatch` (plain lists) and
`ExporterClient` sends it here in one fire-and-forget actor call; `MetricsExporter` owns the replica's
`EngineMetrics`: Ray's export and the replica's own registry, whose families the API port's /metrics asks for.

Lifetime: the replica creates the actor (it owns it), so the actor dies with the replica. It is placed on the
replica's node (softly), so Ray's per-node export shows the series where the replica runs. If it cannot start,
dies, or stops answering (`MAX_PENDING` batches unsettled), the client records in the replica's process again
(a fresh local `EngineMetrics`: the series restart from zero, as after a replica restart, holding the batches
the actor never confirmed) and says so once.
`M3SERVE_METRICS_PROCESS=replica` records in the replica's process from the start (for A/B runs).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

from deploy.metrics import EngineMetrics, TickBatch

logger = logging.getLogger("m3serve.metrics")

MAX_PENDING = 32  # unsettled batches (16 s at the default tick) before the client gives up on the actor
PROCESS_ENV = "M3SERVE_METRICS_PROCESS"  # "exporter" (default) or "replica"


class MetricsExporter:
    """The actor's body: one engine replica's `EngineMetrics` (Ray's export + the replica's own registry)."""

    def __init__(self, model_name: str, role: str, replica: str | int) -> None:
        from deploy.metrics_endpoint import replica_sinks

        sink, self._export = replica_sinks(role)
        self._metrics = EngineMetrics(model_name, role, replica, sink=sink)

    def record_tick(self, batch: TickBatch) -> None:
        self._metrics.record_tick(batch)

    def families(self) -> list:
        return self._export.families()


class ExporterClient:
    """The replica's side (a `TickRecorder`): each batch goes to the exporter actor, or, once that is gone (or
    with no actor at all), to an `EngineMetrics` in this process."""

    def __init__(self, model_name: str, role: str, replica: str | int, actor: Any = None) -> None:
        self._args = (model_name, role, replica)
        self._actor = actor
        # (ref, batch) of record_tick calls not yet known to have run: re-recorded here if the actor is lost
        self._pending: deque[tuple[Any, TickBatch]] = deque()
        self._local: MetricsExporter | None = None if actor is not None else MetricsExporter(*self._args)
        # the reporter's thread records, the event loop asks for families: whichever finds the actor gone moves
        # the batches over, once
        self._lock = threading.Lock()

    @property
    def in_process(self) -> bool:
        """Whether batches are recorded in this process (no actor, or it failed)."""
        return self._local is not None

    def record_tick(self, batch: TickBatch) -> None:
        with self._lock:
            if self._local is None and self._actor_failed():
                self._go_local()
            if self._local is None:
                self._pending.append((self._actor.record_tick.remote(batch), batch))
                return
        self._local.record_tick(batch)

    async def families(self) -> list:
        """The replica's series as the API port's /metrics names them."""
        if self._local is None:
            try:
                return await self._actor.families.remote()
            except Exception:  # noqa: BLE001 - the actor died: record here from now on
                with self._lock:
                    self._go_local()
        return self._local.families()

    def _actor_failed(self) -> bool:
        """Settle the calls that finished (oldest first): an error means the actor is gone; so does a backlog."""
        import ray

        while self._pending:
            ref = self._pending[0][0]
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                break
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - RayActorError and kin: this batch and the later ones are unrecorded
                return True
            self._pending.popleft()
        return len(self._pending) > MAX_PENDING

    def _go_local(self) -> None:
        """Record here from now on, starting with the batches the actor never confirmed (caller holds the lock)."""
        if self._local is not None:
            return
        logger.warning("metrics exporter of %s-%s is gone (%d batches unsettled): recording in the replica's "
                       "process from now on", self._args[1], self._args[2], len(self._pending))
        self._local = MetricsExporter(*self._args)
        while self._pending:
            self._local.record_tick(self._pending.popleft()[1])
        try:
            import ray

            ray.kill(self._actor, no_restart=True)  # one that is only stuck must not export stale series
        except Exception:  # noqa: BLE001 - already dead
            pass


def start_exporter(model_name: str, role: str, replica: str | int) -> ExporterClient:
    """The recorder for an engine replica: an exporter actor on this node when running in Ray (and not turned off
    by `M3SERVE_METRICS_PROCESS=replica`), else one recording in this process."""
    actor = None
    if os.environ.get(PROCESS_ENV, "exporter") != "replica":
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            if ray.is_initialized():
                here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
                actor = ray.remote(MetricsExporter).options(num_cpus=0, max_restarts=0, scheduling_strategy=here
                                                            ).remote(model_name, role, replica)
        except Exception:  # noqa: BLE001 - metrics must never keep a replica from serving
            logger.exception("metrics exporter of %s-%s failed to start: recording in the replica's process",
                             role, replica)
            actor = None
    return ExporterClient(model_name, role, replica, actor)
