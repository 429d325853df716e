"""Where the series of the app's replicas that no handle can address one by one meet: every ingress and router
replica (issue 21).

The API port's `/metrics` is answered by one ingress replica, Serve's choice. It asks each engine replica for its
series itself (each is a deployment of its own, addressable by name), but a call to the `Ingress` or the `Router`
deployment reaches one replica of Serve's choice, never a chosen one, so the other ingress replicas' and every
router replica's series could not be gathered that way: a scrape held only the answering ingress's. Instead each
of those replicas pushes its own families here every `PUSH_S` (`push_forever`), and the answering ingress adds
the latest of every other source to its answer (`deploy/metrics_endpoint.gather`).

Counts read this way are up to `PUSH_S` old, never counted twice: every source's series carry its own `role` and
`replica` labels, the answering ingress leaves its own pushed copy out (it has fresher), and a source that stopped
pushing (its replica died or was replaced) is forgotten after `EXPIRE_S`, so its series end as a dead pod's would.
The hub holds nothing else: if it restarts, the next pushes (within `PUSH_S`) fill it again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ray import serve

logger = logging.getLogger("m3serve.metrics")

HUB_NAME = "MetricsHub"
PUSH_S = 1.0  # how often an ingress or router replica pushes its families
EXPIRE_S = 10.0  # a source not heard from for this long is gone (its replica died or was replaced)
HUB_NUM_CPUS = 0.01  # it stores a few lists


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class MetricsHub:
    """The latest families of every source (an ingress or router replica), by source id."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, list]] = {}

    async def push(self, source: str, families: list) -> None:
        self._latest[source] = (time.monotonic(), families)

    async def families(self, exclude: str | None = None) -> list[list]:
        """The latest families of every live source but `exclude` (the asker: it has its own, fresher)."""
        now = time.monotonic()
        for source in [s for s, (t, _) in self._latest.items() if now - t > EXPIRE_S]:
            del self._latest[source]
        return [fams for source, (_, fams) in self._latest.items() if source != exclude]


def hub_handle() -> Any:
    """This app's hub (from inside one of its replicas)."""
    return serve.get_deployment_handle(HUB_NAME, app_name=serve.get_replica_context().app_name)


async def push_forever(source: str, collect: Callable[[], list], handle: Any = None) -> None:
    """Push `collect()` to the hub (`handle`, else this app's by name) every `PUSH_S`, for the replica's life. A
    failed push (the hub restarting, an app built without one) is logged once per run of failures and tried
    again."""
    failing = False
    while True:
        try:
            handle = handle or hub_handle()
            await handle.push.remote(source, collect())
            failing = False
        except Exception as e:  # noqa: BLE001 - metrics must never take a replica down
            if not failing:
                logger.warning("pushing metrics of %s failed (tried again every %s s): %r", source, PUSH_S, e)
            failing = True
        await asyncio.sleep(PUSH_S)


def start_pushing(source: str, collect: Callable[[], list], handle: Any = None) -> asyncio.Task | None:
    """Start `push_forever` on the running loop (a Serve replica's constructor runs on it); None without one
    (outside Serve: a unit test)."""
    try:
        loop = asyncio.get_running_loop()
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - no loop, or not in a Serve replica
        return None
    return loop.create_task(push_forever(source, collect, handle))
