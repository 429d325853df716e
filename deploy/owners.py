"""Which ingress replicas still live, for the router's direct streams (issue 22, item 5).

The router counts a direct stream on its engine replica from the `Redirect` until the ingress replica that reads it
releases it. An ingress replica that died (`kill -9`, out of memory, its node gone) never releases anything, and
nothing else stops its requests: Ray does not end a stream whose caller died, so the engine ran them on to their
`max_tokens` (measured: 2 of 2 dead ingress's streams `finished`), and the router counted them as load for
`HOLD_TTL_S` (an hour). So each request names its owner, the ingress replica's Ray actor (`this_owner`), and the
router looks every `OWNER_CHECK_S` whether the owners of what it holds still exist (`gone`); what a dead one held
is aborted on its engine replica and released.

A Serve replica is a named Ray actor that is never restarted in place (Serve starts a new replica, under a new
name), and a dead actor's name stops resolving: a failed name lookup is a death, anything else (a slow or
unreachable GCS) is not, so no live request is ever aborted on a doubt.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Awaitable, Callable, Hashable, Iterable, Mapping

logger = logging.getLogger("m3serve.router")

OWNER_CHECK_S = 1.0  # how often the router looks whether the ingress replicas it holds streams of still live
LOOKUP_TIMEOUT_S = 5.0  # a lookup that takes longer proves nothing (counted alive this round)

Owner = tuple[str, str]  # (Ray namespace, actor name) of an ingress replica


@dataclasses.dataclass(frozen=True)
class Held:
    """A direct stream the router counts on engine replica `key` until its ingress releases it: the engine
    replica's request id (to abort it there if `owner`, the ingress replica reading it, dies first) and since
    when."""

    key: Hashable
    since: float
    engine_rid: str
    owner: Owner | None


def this_owner() -> Owner | None:
    """This process's actor as an owner (None outside a named Ray actor: a unit test, a script)."""
    try:
        import ray

        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - not in Ray
        return None
    # Serve creates its replicas in its own namespace, not the job's (which the runtime context reports)
    return (_serve_namespace(), name) if name else None


def _serve_namespace() -> str:
    try:
        from ray.serve._private.constants import SERVE_NAMESPACE

        return SERVE_NAMESPACE
    except ImportError:  # moved: the value it has had since Serve began
        return "serve"


def _dead(owner: Owner) -> bool:
    import ray

    try:
        ray.get_actor(owner[1], namespace=owner[0])
    except ValueError:  # "Failed to look up actor": no live actor has that name
        return True
    except Exception:  # noqa: BLE001 - the GCS did not answer: no proof of death
        logger.warning("looking up ingress replica %s failed", owner[1], exc_info=True)
    return False


async def gone(owners: Iterable[Owner]) -> set[Owner]:
    """Those of `owners` that are dead (their actor name no longer resolves)."""
    owners = list(owners)

    async def one(owner: Owner) -> bool:
        try:
            return await asyncio.wait_for(asyncio.to_thread(_dead, owner), LOOKUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            return False

    results = await asyncio.gather(*(one(o) for o in owners))
    return {o for o, dead in zip(owners, results) if dead}


async def watch(held: Mapping[str, Held], release: Callable[[str], None],
                abort: Callable[[Hashable, str], Awaitable[None]], orphaned: Callable[[int], None]) -> None:
    """While `held` (the router's direct streams, by request id) is not empty: every `OWNER_CHECK_S`, release
    every stream whose owner died and `abort` it on its engine replica (it would never be released, and its engine
    would run it on to its max_tokens); `orphaned(n)` counts them."""
    while held:
        await asyncio.sleep(OWNER_CHECK_S)
        try:
            owners = {h.owner for h in held.values() if h.owner is not None}
            dead = await gone(owners) if owners else set()
            orphans = [(rid, h) for rid, h in list(held.items()) if h.owner in dead]
            for rid, _ in orphans:
                release(rid)
            if orphans:
                orphaned(len(orphans))
                logger.warning("ingress replica(s) %s died holding %d stream(s): aborted",
                               sorted(o[1] for o in dead), len(orphans))
            await asyncio.gather(*(abort(h.key, h.engine_rid) for _, h in orphans))
        except Exception:  # noqa: BLE001 - the next round tries again
            logger.exception("ingress replica watch")
