"""Prefill/decode disaggregation of one request, as an explicit state machine (docs/disaggregation.md).

The router (deploy/router.py) chooses replicas and counts load; this module runs a disaggregated request across
the replicas it chooses, phase by phase (`Phase`, entered in this order):

  PLACE        a prefill replica wired to some decode replica is chosen; with attention DP, its dp rank that runs
               the request (the decode side must know whose shards send before the prefill runs)
  ADMIT        the first decode replica with room reserves the request's pages and names where the KV goes
               (every one full: it tries again until `admit_wait_s`, then 503 `kv_capacity`)
  PREFILL      the prefill replica's stream is open: it runs the prompt and sends the KV, first token in its header
  FIRST_TOKEN  the first token came back here (and went to the client at once, on a first attempt)
  TRANSFER     `retry_prefill` only: waiting for the transfer's outcome; a failure goes back to PLACE, once
  DECODE       the `Redirect` to the decode replica is handed over: the ingress streams the rest from there

Two ways through. Decode-first (the default): the ingress's stream opens on the decode replica right after PREFILL
and carries the first token too, from the KV header: PLACE -> ADMIT -> PREFILL -> DECODE. First-token (with
`retry_prefill`, whose stream would be the first attempt's, or prompt logprobs, which the prefill computes):
PLACE -> ADMIT -> PREFILL -> FIRST_TOKEN [-> TRANSFER] -> DECODE. Once the decode stream is the client's, the rest
of the prefill's stream (the transfer's outcome) is read in the background (`_watch_prefill`).

What happens on each failure is one table, `ON_FAILURE`, and one method that does it, `_settle`; a request cut
midway (the client left, or something raised) is `_cut`. `on_phase`, when given, is awaited as each phase is
entered: the seam where `deploy.testing.DrillRouter` holds a request (production passes None).
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from typing import AsyncIterator, Awaitable, Callable, Literal, Protocol

from ray.serve.handle import DeploymentHandle

from deploy.owners import Owner
from deploy.protocol import EngineChunk, EngineError, EngineEvent, EngineRequest, Redirect
from deploy.server_pd import Admitted, FirstToken, TransferOutcome
from deploy.wiring import ReplicaKey, Wiring
from workers.kv.config import TransferConfig

logger = logging.getLogger("m3serve.router")

RETRY_AFTER_UNWIRED_S = 2.0  # no wired pair: a replica restarts (the watchdog wires it once it is ready)


class Phase(enum.Enum):
    PLACE = "place"
    ADMIT = "admit"
    PREFILL = "prefill"
    FIRST_TOKEN = "first_token"
    TRANSFER = "transfer"
    DECODE = "decode"


class Failure(enum.Enum):
    PLACE_FAILED = "place_failed"  # the prefill replica did not answer where it places the request
    ADMIT_REFUSED = "admit_refused"  # no decode replica took it (full, unwired, unreachable)
    PREFILL_REFUSED = "prefill_refused"  # the prefill replica answered an error instead of a first token
    FINISHED_AT_PREFILL = "finished_at_prefill"  # the first token ended it: nothing to decode (not an error)
    TRANSFER_FAILED = "transfer_failed"  # (retry) the KV did not arrive: the prefill runs once more
    # the same, seen after the redirect: the decode replica's stream is the client's, so the decode replica is told
    # (`fail_remote` frees its pages and ends its stream with the answer) instead of aborted
    PREFILL_REFUSED_LATE = "prefill_refused_late"
    FINISHED_AT_PREFILL_LATE = "finished_at_prefill_late"
    TRANSFER_FAILED_LATE = "transfer_failed_late"


@dataclasses.dataclass(frozen=True)
class OnFailure:
    """What a failure costs: the handoff outcome counted, what the decode replica is told ("abort": free the
    reservation; "fail": end its client's stream with the answer), whether a placement held on the prefill
    replica (attention DP) is let go, whether a `kv_unwired` answer re-wires now, and whether the pair is
    checked and replaced if it broke."""

    outcome: str
    decode: Literal["abort", "fail"] | None = None
    placement: bool = False
    rewire: bool = False
    repair: bool = False


ON_FAILURE: dict[Failure, OnFailure] = {
    Failure.PLACE_FAILED: OnFailure("refused"),
    Failure.ADMIT_REFUSED: OnFailure("refused", placement=True),
    Failure.PREFILL_REFUSED: OnFailure("refused", decode="abort", placement=True, rewire=True),
    Failure.FINISHED_AT_PREFILL: OnFailure("finished_at_prefill", decode="abort"),
    Failure.TRANSFER_FAILED: OnFailure("transfer_failed", decode="abort", repair=True),
    Failure.PREFILL_REFUSED_LATE: OnFailure("refused", decode="fail", placement=True, rewire=True),
    Failure.FINISHED_AT_PREFILL_LATE: OnFailure("finished_at_prefill", decode="fail"),
    # fail first: dropping a broken pair would fail the request too, under a vaguer reason ("closed")
    Failure.TRANSFER_FAILED_LATE: OnFailure("transfer_failed", decode="fail", repair=True),
}


class Replicas(Protocol):
    """The router's replica choice and load (deploy/router.py)."""

    def pick(self, role: str, among: list[ReplicaKey] | None = None) -> ReplicaKey: ...

    def decode_order(self, p: ReplicaKey, wired: Callable[[ReplicaKey], bool]) -> list[ReplicaKey]: ...

    def count_in(self, key: ReplicaKey) -> None: ...

    def count_out(self, key: ReplicaKey) -> None: ...


@dataclasses.dataclass(eq=False)
class _Run:
    """One disaggregated request as it goes through the phases."""

    req: EngineRequest
    owner: Owner | None
    prefills: list[ReplicaKey]  # prefill replicas wired to some decode replica
    decode_first: bool
    attempts: int
    attempt: int = 0
    sub: EngineRequest | None = None  # this attempt's request (a retry runs under a new id)
    p: ReplicaKey | None = None
    p_rank: int | None = None  # the prefill replica's dp rank that runs it (attention DP), else None
    d: ReplicaKey | None = None
    send_to: str | None = None
    pstream: object = None  # this attempt's prefill stream
    event: EngineChunk | None = None  # this attempt's first token
    first: EngineChunk | None = None  # the first token the client got
    touched: list[tuple[ReplicaKey, str]] = dataclasses.field(default_factory=list)  # where an abort must reach
    busy: list[ReplicaKey] = dataclasses.field(default_factory=list)  # in-flight counts to give back
    streams: list = dataclasses.field(default_factory=list)  # cancelled if the request is cut
    done: bool = False  # ended with an answer or handed over: nothing to abort

    @property
    def rid(self) -> str:
        return self.req.request_id

    @property
    def tid(self) -> str:
        """This attempt's id on both replicas (the transfer id too)."""
        return self.sub.request_id


Step = tuple[Phase | None, list]  # the next phase (None: the request left this machine) and events for the client


class PrefillDecode:
    """Runs disaggregated requests for one router (`run`), and what it started in the background."""

    def __init__(self, engines: dict[ReplicaKey, DeploymentHandle], wiring: Wiring, replicas: Replicas,
                 config: TransferConfig, prefill_dp: int, *, hold: Callable[..., Redirect],
                 release: Callable[[str], None], handoff: Callable[[str], None],
                 on_phase: Callable[[str, Phase], Awaitable[None]] | None = None) -> None:
        """`config`: the serve config's transfer section (this reads `retry_prefill` and `admit_wait_s`);
        `prefill_dp`: attention DP on the prefill replicas (each request is placed on a dp rank first).
        `hold(rid, key, method, args, engine_rid, owner)`: count `rid` on `key` until released, and the
        `Redirect` to hand over; `release(rid)`: stop counting it; `handoff(outcome)`: count a handoff outcome."""
        self.config = config
        self._prefill_dp = prefill_dp
        self._engines, self._wiring, self._replicas = engines, wiring, replicas
        self._hold, self._release, self._handoff = hold, release, handoff
        self.on_phase = on_phase  # awaited as each phase is entered (a test seam; None in production)
        self._touched: dict[str, list[tuple[ReplicaKey, str]]] = {}  # request id -> where an abort must reach
        # decode-first requests whose prefill has not answered yet: request id -> (prefill replica, transfer id,
        # its prefill stream); a release before that (the client left) stops the prefill too
        self._prefilling: dict[str, tuple[ReplicaKey, str, object]] = {}
        self._background: set[asyncio.Task] = set()

    # -- the router's calls ---------------------------------------------------------------------------------
    def touched(self, rid: str) -> list[tuple[ReplicaKey, str]] | None:
        """Where an abort of `rid` must reach while it is here (None: not here)."""
        return self._touched.get(rid)

    def released(self, rid: str) -> None:
        """The ingress released `rid`: a prefill not answered yet need not run on (the client left)."""
        prefilling = self._prefilling.pop(rid, None)
        if prefilling is not None:
            p, tid, pstream = prefilling
            pstream.cancel()  # its replica aborts the request (and the watcher reads the stream's end)
            self._spawn(abort_on(self._engines, p, tid))  # a placement not run yet

    async def run(self, req: EngineRequest, owner: Owner | None) -> AsyncIterator[EngineEvent | Redirect]:
        """A disaggregated request's events for the ingress: a refusal, or (first-token path) the first token,
        then a `Redirect` to the decode replica. `owner`: the ingress replica that will read the decode stream."""
        refused = await self._refuse(req)
        if isinstance(refused, EngineError):
            yield refused
            return
        run = _Run(req=req, owner=owner, prefills=refused, attempts=2 if self.config.retry_prefill else 1,
                   decode_first=not self.config.retry_prefill and req.params.prompt_logprobs is None)
        self._touched[run.rid] = run.touched
        steps = {Phase.PLACE: self._place, Phase.ADMIT: self._admit, Phase.PREFILL: self._prefill,
                 Phase.FIRST_TOKEN: self._first_token, Phase.TRANSFER: self._transfer, Phase.DECODE: self._decode}
        try:
            phase: Phase | None = Phase.PLACE
            while phase is not None:
                if self.on_phase is not None:
                    await self.on_phase(run.rid, phase)
                phase, events = await steps[phase](run)
                for event in events:
                    if not isinstance(event, Redirect):
                        yield event
                        continue
                    try:  # from here the decode replica's count is the ingress's to give back
                        yield event
                        run.done = True
                    finally:
                        if not run.done:  # cancelled before it left: given back here
                            self._release(run.rid)
        finally:
            await self._cut(run)

    # -- before anything is held ----------------------------------------------------------------------------
    async def _refuse(self, req: EngineRequest) -> EngineError | list[ReplicaKey]:
        """An answer that needs nothing held (bad `n`, no pairs), else the prefill replicas that can take it."""
        if req.params.n != 1:
            return EngineError(status=400, param="n",
                               message=f"n: disaggregated serving runs one sample per request, got n={req.params.n}")
        self._wiring.start_watchdog()
        try:
            await self._wiring.ensure_logged(wait=bool(self._wiring.want()) and not self._wiring.as_dict())
        except Exception as e:
            logger.exception("opening KV pairs failed")
            return EngineError(status=503, message=f"KV transfer pairs could not be opened: {e}",
                               code="kv_transfer_unavailable", retry_after=5.0)
        prefills = [p for p in self._wiring.prefills() if self._wiring.decodes_of(p)]
        return prefills or unwired_error()  # none: a replica is down or restarting, nothing can carry the KV

    # -- the phases -----------------------------------------------------------------------------------------
    async def _place(self, run: _Run) -> Step:
        run.sub = run.req if run.attempt == 0 else dataclasses.replace(
            run.req, request_id=f"{run.rid}#retry{run.attempt}")
        run.p = self._replicas.pick("prefill", run.prefills)
        run.touched.append((run.p, run.tid))  # from here an abort must reach it (a placement is held there)
        placed = await self._place_on(run.p, run.sub)
        if isinstance(placed, EngineError):
            return await self._end(run, Failure.PLACE_FAILED, placed)
        run.p_rank = placed
        return Phase.ADMIT, []

    async def _admit(self, run: _Run) -> Step:
        # a retry's first token differs from the one the client has: its decode waits to be handed that
        admitted = await self._admit_somewhere(run.sub, run.p, run.p_rank, first_from_kv=run.attempt == 0)
        if isinstance(admitted, EngineError):
            return await self._end(run, Failure.ADMIT_REFUSED, admitted)
        run.d, run.send_to = admitted
        run.touched.append((run.d, run.tid))
        for key in (run.d, run.p):
            self._replicas.count_in(key)
            run.busy.append(key)
        return Phase.PREFILL, []

    async def _prefill(self, run: _Run) -> Step:
        run.pstream = self._engines[run.p].options(stream=True).prefill.remote(run.sub, run.send_to, run.tid)
        if run.decode_first:  # the decode replica's stream carries the first token: watch the prefill aside
            run.busy.remove(run.p)
            self._watch_prefill(run, first=None)
            return Phase.DECODE, []
        run.streams.append(run.pstream)
        event = await next_event(run.pstream, f"prefill replica {run.p[1]}")
        if isinstance(event, EngineError):
            return await self._end(run, Failure.PREFILL_REFUSED, event)
        run.event = event
        if run.first is not None:  # a retry: the client has its first token already
            return Phase.FIRST_TOKEN, []
        run.first = event
        if event.finished:
            return await self._end(run, Failure.FINISHED_AT_PREFILL, event)
        return Phase.FIRST_TOKEN, [event]  # the client gets the first token now, while the KV travels

    async def _first_token(self, run: _Run) -> Step:
        if run.attempt + 1 < run.attempts:
            return Phase.TRANSFER, []
        # Nothing left to retry: go on to the decode replica now, which starts when the KV lands; the transfer's
        # outcome is watched on the side (a failure the decode side cannot see fails it there).
        run.busy.remove(run.p)
        run.streams.remove(run.pstream)
        self._watch_prefill(run, first=run.event)
        return Phase.DECODE, []

    async def _transfer(self, run: _Run) -> Step:
        outcome = await next_event(run.pstream, f"prefill replica {run.p[1]}")
        self._replicas.count_out(run.p)
        run.busy.remove(run.p)
        if isinstance(outcome, TransferOutcome) and outcome.ok:
            self._handoff("ok")
            return Phase.DECODE, []
        await self._settle(run, Failure.TRANSFER_FAILED, outcome)
        run.attempt += 1
        return Phase.PLACE, []  # and run the prefill once more

    async def _decode(self, run: _Run) -> Step:
        run.busy.remove(run.d)  # the ingress's from here, like a unified redirect
        token = None
        if not run.decode_first:
            sample = run.first.samples[0]
            token = FirstToken(token_id=sample.token_ids[0], logprobs=sample.logprobs[0] if sample.logprobs else None)
        return None, [self._hold(run.rid, run.d, "decode", (run.sub, token), run.tid, run.owner)]

    # -- failures -------------------------------------------------------------------------------------------
    async def _end(self, run: _Run, failure: Failure, answer: EngineEvent) -> Step:
        """End the request here with `answer` after settling `failure`."""
        await self._settle(run, failure, answer)
        run.done = True
        return None, [answer]

    async def _settle(self, run: _Run, failure: Failure, answer) -> None:
        """Do what `ON_FAILURE[failure]` says, for `run`'s current attempt."""
        rule = ON_FAILURE[failure]
        self._handoff(rule.outcome)
        if rule.rewire and isinstance(answer, EngineError) and answer.code == "kv_unwired":
            # the prefill replica restarted before the watchdog saw it: re-wire now, in the background (this
            # request has its answer; the next ones find the pair)
            self._spawn(self._wiring.rewire_now())
        why = None
        if failure in (Failure.TRANSFER_FAILED, Failure.TRANSFER_FAILED_LATE):
            why = answer.reason if isinstance(answer, TransferOutcome) else getattr(answer, "message", answer)
            logger.warning("request %s: KV transfer %s -> %s failed: %s", run.tid, run.p, run.d, why)
        if rule.decode == "abort":
            await abort_on(self._engines, run.d, run.tid)
        if rule.placement and run.p_rank is not None and isinstance(answer, EngineError):
            await abort_on(self._engines, run.p, run.tid)  # refused before it was added: its placement is held
        if rule.decode == "fail":
            late = (f"KV transfer failed: {why}", None) if why is not None else \
                ("the prefill answered without handing off", answer)
            await self._fail_decode(run.d, run.tid, *late)
        if rule.repair:
            await self._wiring.repair(run.p, run.d)

    async def _cut(self, run: _Run) -> None:
        """The request leaves: give back its in-flight counts; if it was cut (the client left, or something
        raised) before an answer or a handover, both sides let go of its pages."""
        for key in run.busy:
            self._replicas.count_out(key)
        self._touched.pop(run.rid, None)
        if not run.done:
            for s in run.streams:
                s.cancel()
            await asyncio.gather(*(abort_on(self._engines, k, eid) for k, eid in run.touched),
                                 return_exceptions=True)

    # -- in the background ----------------------------------------------------------------------------------
    def _watch_prefill(self, run: _Run, *, first: EngineChunk | None) -> None:
        """In the background: the rest of the prefill replica's stream, once the decode replica's stream is (or is
        about to be) the client's. `first`: its first event, already read; else (decode-first) it is read here,
        and if the prefill answered instead of handing off (a refusal, or the first token ended the request) the
        decode replica ends its stream with that answer. Then the transfer's outcome: a failure fails the request
        on the decode replica, then replaces the pair if it broke; the decode side sees a refused or broken
        payload itself, but not a sender that never sent (no pairs, peer gone before the header) until its
        lease."""
        p, rid, pstream = run.p, run.rid, run.pstream

        async def watch() -> None:
            try:
                if first is None:
                    try:
                        event = await next_event(pstream, f"prefill replica {p[1]}")
                    finally:
                        self._prefilling.pop(rid, None)
                    if isinstance(event, EngineError) or event.finished:
                        await self._settle(run, Failure.PREFILL_REFUSED_LATE if isinstance(event, EngineError)
                                           else Failure.FINISHED_AT_PREFILL_LATE, event)
                        return
                outcome = await next_event(pstream, f"prefill replica {p[1]}")
            finally:
                self._replicas.count_out(p)
            if isinstance(outcome, TransferOutcome) and outcome.ok:
                self._handoff("ok")
                return
            await self._settle(run, Failure.TRANSFER_FAILED_LATE, outcome)

        if first is None:  # registered before the redirect leaves: a release may come before the task runs
            self._prefilling[rid] = (p, run.tid, pstream)
        self._spawn(watch())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- calls to the replicas ------------------------------------------------------------------------------
    async def _place_on(self, p: ReplicaKey, req: EngineRequest) -> int | None | EngineError:
        """The dp rank of prefill replica `p` that will run `req` (None without attention DP): the decode side
        must know it before the prefill runs, to prepare the receive from that rank's shards. The prompt length
        goes along: the replica balances its dp ranks by prompt tokens still to prefill, not by requests."""
        if self._prefill_dp == 1:
            return None
        try:
            return await self._engines[p].place.remote(req.request_id, len(req.prompt_token_ids))
        except Exception as e:  # that replica is gone
            return EngineError(status=503, message=f"prefill replica {p[1]} unreachable ({type(e).__name__})",
                               code="engine_unavailable", retry_after=1.0)

    async def _admit_somewhere(self, req: EngineRequest, p: ReplicaKey, p_rank: int | None,
                               first_from_kv: bool) -> tuple[ReplicaKey, str] | EngineError:
        """Reserve the request's pages on the first decode replica with room: (that replica, the group name its
        prefill sends the KV to: the replica's, or with attention DP the admitting dp rank's sub-group).
        `first_from_kv`: the decode starts when the KV lands, with the first token from the KV header.
        While every replica is full, it tries again (backing off 10 -> 200 ms) until `admit_wait_s`. A replica
        that answers `kv_unwired` (it restarted, or `p` did, before the watchdog saw it) makes the router re-wire
        now and try once more."""
        deadline = time.monotonic() + self.config.admit_wait_s
        delay = 0.01
        rewired = False
        while True:
            admitted = await self._admit_once(req, p, p_rank, first_from_kv)
            if isinstance(admitted, EngineError) and admitted.code == "kv_unwired" and not rewired:
                rewired = True
                await self._wiring.rewire_now()
                continue
            if not (isinstance(admitted, EngineError) and admitted.code == "kv_capacity"):
                return admitted
            if time.monotonic() + delay > deadline:
                return admitted
            await asyncio.sleep(delay)  # a cancelled client cancels this wait: nothing is reserved yet
            delay = min(2 * delay, 0.2)

    async def _admit_once(self, req: EngineRequest, p: ReplicaKey, p_rank: int | None,
                          first_from_kv: bool) -> tuple[ReplicaKey, str] | EngineError:
        """One pass over the decode replicas wired to `p`, best first (see `_admit_somewhere`)."""
        full = None
        wiring = self._wiring
        for d in self._replicas.decode_order(p, lambda d: wiring.generation(p, d) is not None):
            gen = wiring.generation(p, d)
            if gen is None:  # dropped since the order was made (a re-wire)
                continue
            try:
                res = await self._engines[d].admit.remote(req, wiring.group(p, gen), req.request_id,
                                                          wiring.group(d, gen), p_rank, first_from_kv)
            except Exception as e:  # that replica is gone: try the next
                full = EngineError(status=503, message=f"decode replica {d[1]} unreachable ({type(e).__name__})",
                                   code="engine_unavailable", retry_after=1.0)
                continue
            if isinstance(res, Admitted):
                return d, res.send_to or wiring.group(d, gen)
            if res.code not in ("kv_capacity", "kv_unwired"):
                return res
            if full is None or full.code != "kv_capacity":
                full = res
        if full is not None and full.code == "kv_capacity":
            return EngineError(status=503, code="kv_capacity", retry_after=full.retry_after,
                               message=f"no decode replica has room for this request's KV pages now ({full.message})")
        return full or unwired_error()

    async def _fail_decode(self, d: ReplicaKey, tid: str, why: str, answer: EngineEvent | None = None) -> None:
        try:
            await self._engines[d].fail_remote.remote(tid, why, answer)
        except Exception:  # the decode replica is gone: its pages went with it
            logger.warning("fail_remote of %s on %s failed", tid, d)


async def abort_on(engines: dict[ReplicaKey, DeploymentHandle], key: ReplicaKey, engine_request_id: str) -> None:
    """Abort a request on one engine replica; a replica that is gone took its pages with it."""
    try:
        await engines[key].abort.remote(engine_request_id)
    except Exception:
        logger.warning("abort of %s on %s failed", engine_request_id, key)


def unwired_error() -> EngineError:
    return EngineError(status=503, code="kv_unwired", retry_after=RETRY_AFTER_UNWIRED_S,
                       message="no prefill and decode replica are wired for KV transfer now (a replica is down or "
                               "restarting; the router wires it again once it is ready): retry")


async def next_event(stream, what: str):
    """The next event of a replica's stream; its end or a transport failure becomes an EngineError."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return EngineError(status=500, message=f"{what} ended the request without a result", code="internal_error")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the replica died
        return EngineError(status=503, message=f"{what} failed ({type(e).__name__}: {e})", code="engine_unavailable",
                           retry_after=1.0)
