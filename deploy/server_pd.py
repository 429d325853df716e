"""The KV side of an engine replica (docs/disaggregation.md): what the router calls on a prefill or decode
`EngineServer` besides its request streams, and the messages of the prefill/decode protocol.

A prefill replica with attention DP answers `place` (the dp rank whose shards will send a request's KV); a decode
replica answers `admit` (reserve the pages and say where the KV goes; refusal = an `EngineError`) and `fail_remote`
(the prefill side failed to send); both open and close KV pairs (`kv_listen` / `kv_connect`, `kv_drop`,
`kv_broken`). `KVSide` is a mixin of `EngineServer` (deploy/server.py): Serve calls a deployment's methods by
name, so they must be the deployment class's own; grouping them here keeps the server's room findable. It reads
the server's state (`_engine`, `_counters`, `_answers`, `_dp_admissions`, `_transfer_totals`, `_reporter`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from deploy.protocol import EngineError, EngineEvent, EngineRequest, param_of

RETRY_AFTER_KV_S = 1.0
RETRY_AFTER_UNWIRED_S = 1.0  # a replica the router has not wired (again) yet: its watchdog does within ~1 s
KEEP_ANSWERS = 1024  # prefill answers kept for decode streams that have not come yet (fail_remote)


@dataclass(frozen=True, kw_only=True)
class TransferOutcome:
    """Prefill replica -> router: the handed-off request's KV reached the decode replica (ok) or not (why)."""

    ok: bool
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class Admitted:
    """Decode replica -> router: the request's pages are reserved; the prefill replica sends its KV to `send_to`."""

    num_pages: int
    dp_rank: int | None = None  # the attention-DP rank that holds the pages (None: a dp=1 engine)
    # the decode group name the router gave, or with attention DP its dp rank's sub-group (None: none was given)
    send_to: str | None = None


@dataclass(frozen=True, kw_only=True)
class FirstToken:
    """Router -> decode replica: what prefill sampled (the client already has it)."""

    token_id: int
    logprobs: dict[int, float] | None = None


class KVSide:
    """The KV pair, placement and admission calls of an `EngineServer` (see the module docstring)."""

    # -- prefill side: placement and pairs --------------------------------------------------------------------
    async def place(self, request_id: str, num_tokens: int | None = None) -> int | None:
        """Prefill with attention DP: the dp rank that will run `request_id`, a prompt of `num_tokens` tokens
        (the rank with the fewest prompt tokens still to prefill; held for its `prefill` call; an `abort` lets
        it go), so the decode replica can prepare the receive from that rank's shards. None for a dp=1 engine
        (or one not loaded: its `prefill` answers why). Not through the step thread: a placement must not wait
        for the prefill step in progress."""
        engine = getattr(self._engine, "engine", None)
        place = getattr(engine, "place_request", None)  # DPEngine only
        if place is None:
            return None
        rank = place(request_id, num_tokens)
        self._dp_admissions[rank] = self._dp_admissions.get(rank, 0) + 1
        return rank

    async def kv_connect(self, decode_group: str, listened: list) -> None:
        """Join the pairs a decode replica listens on; returns when they are open."""
        await self._require_engine().call(lambda e: e.kv_connect(decode_group, listened))
        engine = self._engine.engine
        await asyncio.to_thread(engine.kv_wait_ready, None, decode_group)

    # -- decode side: admission, failure, pairs ------------------------------------------------------------
    async def admit(self, req: EngineRequest, prefill_group: str, transfer_id: str | None = None,
                    decode_group: str | None = None, prefill_dp_rank: int | None = None,
                    first_from_kv: bool = True) -> Admitted | EngineError:
        """Reserve the pages of a prompt that `prefill_group` computes (on its dp rank `prefill_dp_rank`, when
        the prefill replica has attention DP: the receive then expects that rank's shards): an `Admitted`
        (page count, dp rank, and where prefill must send the KV: `decode_group`, this replica's name on the
        prefill side, or with attention DP the admitting dp rank's sub-group of it), or an `EngineError` (503
        `kv_capacity` when this replica has no room now, 400 for a request it can never serve).
        `first_from_kv`: the request starts decoding when its KV lands, with the first token from the KV header
        (False: when `decode` hands it the token, for a retried prefill whose first token the client already has
        from the first attempt)."""
        if self._engine is None:
            return self._not_ready()
        from workers.kv.agent import UnwiredGroupError

        rid = req.request_id
        if not self._wired(prefill_group):
            self._counters["rejected"] += 1
            return self._unwired(prefill_group)
        if prefill_dp_rank is not None:
            from workers.kv.agent import TransferAgent

            prefill_group = TransferAgent.dp_group(prefill_group, prefill_dp_rank)

        def reserve(engine) -> tuple[list[int] | None, int | None]:
            # one step-thread call: the dp rank is read before anything (a step, an abort) can move the request
            pages = engine.admit_remote(rid, req.prompt_token_ids, req.params, group=prefill_group,
                                        transfer_id=transfer_id, prompt=req.prompt, first_from_kv=first_from_kv)
            rank_of = getattr(engine, "dp_rank_of", None)  # DPEngine only
            return pages, (rank_of(rid) if pages is not None and rank_of is not None else None)

        try:
            self._engine.engine.validate_request(list(req.prompt_token_ids), req.params)
            pages, dp_rank = await self._engine.call(reserve)
        except UnwiredGroupError:  # the router dropped that generation meanwhile (a re-wire): retryable
            self._counters["rejected"] += 1
            return self._unwired(prefill_group)
        except ValueError as e:
            self._counters["rejected"] += 1
            return EngineError(status=400, message=str(e), param=param_of(str(e)))
        if pages is None:
            self._counters["rejected"] += 1
            free = self._engine.stats().num_pages_free
            return EngineError(status=503, code="kv_capacity", retry_after=RETRY_AFTER_KV_S,
                               message=f"decode replica {self._index}: no room for the prompt's KV pages now "
                                       f"({free} pages free)")
        if dp_rank is not None:
            self._dp_admissions[dp_rank] = self._dp_admissions.get(dp_rank, 0) + 1
        send_to = decode_group
        if decode_group is not None and dp_rank is not None:
            from workers.kv.agent import TransferAgent

            send_to = TransferAgent.dp_group(decode_group, dp_rank)
        return Admitted(num_pages=len(pages), dp_rank=dp_rank, send_to=send_to)

    async def fail_remote(self, request_id: str, why: str, answer: EngineEvent | None = None) -> bool:
        """The router heard from the prefill replica that this admitted request's KV will not come: fail it
        now and free its pages. Its `decode` stream ends with `answer` when given (what the prefill answered
        instead: its refusal, or its first chunk when that token ended the request; for a stream opened before
        the prefill ran), else with 503 `kv_transfer_failed` naming `why`. False when it is not waiting for its
        KV (landed, unknown, failed or aborted already)."""
        if self._engine is None:
            return False
        if answer is not None:
            self._answers[request_id] = answer
            while len(self._answers) > KEEP_ANSWERS:  # answers of streams that never came
                self._answers.pop(next(iter(self._answers)))
        failed = await self._engine.fail_remote(request_id, why)
        if not failed:
            self._answers.pop(request_id, None)
        return failed

    async def dp_admissions(self) -> dict[int, int]:
        """With attention DP: how many requests each dp rank took so far (decode: admitted; prefill: placed;
        empty for dp=1)."""
        return dict(self._dp_admissions)

    async def kv_listen(self, prefill_group: str, prefill_tp: int, prefill_dp: int = 1) -> list:
        """Open the pairs from a prefill replica's shards (per prefill dp rank when it has attention DP);
        returns what they `kv_connect` to."""
        return await self._require_engine().call(lambda e: e.kv_listen(prefill_group, prefill_tp, prefill_dp))

    async def kv_drop(self, group: str) -> None:
        await self._require_engine().call(lambda e: e.kv_drop(group))

    async def kv_broken(self, group: str) -> str | None:
        return await self._require_engine().call(lambda e: e.kv_broken(group))

    async def transfer_totals(self) -> dict:
        """Totals of the KV transfers fed to the metrics (`transfers`, `failed`, `bytes`, `seconds`)."""
        if self._reporter is not None:
            await asyncio.to_thread(self._reporter.tick)  # off the loop: it may wait for a tick in progress
        return dict(self._transfer_totals)

    def _wired(self, group: str) -> bool:
        """Whether this engine has KV pairs with the remote group `group` (off the step thread: a dict read)."""
        return any(kv.pairs.wired(group) for kv in self._engine.engine.connectors)

    def _unwired(self, group: str) -> EngineError:
        """A request names a peer group this replica has no pairs with: this replica or its peer restarted and
        the router has not re-wired them yet (it does on its own): retryable, not the client's fault."""
        return EngineError(status=503, code="kv_unwired", retry_after=RETRY_AFTER_UNWIRED_S,
                           message=f"{self._role} replica {self._index} has no KV pairs with {group!r} (a replica "
                                   f"restarted; the router is re-wiring them): retry")

