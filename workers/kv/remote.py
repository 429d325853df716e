"""`DecodeConnector`: a decode engine core's requests whose prompt KV comes from a prefill group.

`admit_remote` reserves a request's pages on the core and has every shard prepare the receive; the request
starts decoding (`EngineCore.activate_remote`, from `poll`) as soon as its KV landed and its first token is known:
the token rides in the KV header, or (a retried prefill) comes through `continue_remote`. A request whose KV
cannot come is failed (`pop_failures`), and its pages are freed once every shard's part of the transfer settled.

Nothing here calls an agent: a prepare rides the next step (the engine runs a KV-only step for it at once, so
the receive is posted before the admission returns, before the prefill side may send), aborts and releases the
step after; each step's results of the awaited transfers come back in its `KVEvents` (`poll` reads them).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from workers.core import EngineCore, EngineCoreOutput
from workers.kv.config import TransferState
from workers.kv.agent import UnwiredGroupError
from workers.kv.commands import Prepare
from workers.kv.connector import KVConnector, first_token_from_meta
from workers.request import SamplingParams
from workers.scheduler import Request


@dataclass(eq=False, kw_only=True)
class _Remote:
    """A request whose pages are reserved and whose prompt KV comes from a prefill engine."""

    transfer_id: str
    created: float
    first: tuple[int, dict[int, float] | None] | None = None  # the first token and its logprobs, from prefill
    # take the first token from the KV header (the prefill's sample travels with its pages), so decoding starts
    # when the pages land; False: wait for `continue_remote` (a retried prefill: the client has another token)
    first_from_kv: bool = True
    landed: bool = False
    aborted: bool = False  # by the client, or failed: the pages go once the transfer settled
    seen_since_abort: bool = False  # a step's results came after the abort went out (so they are its own)
    failure: str | None = None


class DecodeConnector(KVConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._remote: dict[str, _Remote] = {}
        self._failures: list[tuple[str, str]] = []  # (request id, reason): requests that lost their KV
        self._dropped: list[str] = []  # ended by their transfer since the last poll
        # failed, their pages freed and release queued: reported (`pop_failures`) once the step that releases
        # them ran, so a failure means nothing of the request is left here
        self._releasing: list[tuple[str, str]] = []

    def holds(self, request_id: str) -> bool:
        return request_id in self._remote

    def request_ids(self) -> list[str]:
        return list(self._remote)

    def has_pending(self) -> bool:
        return bool(self._remote or self._releasing)

    @property
    def num_awaiting_kv(self) -> int:
        return len(self._remote)

    def admit_remote(self, core: EngineCore, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, *, group: str, transfer_id: str | None = None,
                     arrival_time: float | None = None, first_from_kv: bool = True) -> Request | None:
        """Reserve the prompt's pages on `core` and prepare the receive from prefill group `group` on every
        shard; None when the pool has no room now (ValueError naming the field: it can never be served)."""
        req = core.add_remote(request_id, prompt_token_ids, params, arrival_time=arrival_time)
        if req is None:
            return None
        page_ids = list(core.pages.page_table(req.seqs[0].seq_id))
        tid = transfer_id or request_id
        self._out.prepare.append(Prepare(tid, tuple(page_ids), group))
        self._remote[request_id] = _Remote(transfer_id=tid, created=time.monotonic(), first_from_kv=first_from_kv)
        self.mark("admitted", request_id)
        return req

    def check_admitted(self, core: EngineCore, request_id: str) -> None:
        """After the step that ran its prepare: raise the error a shard met (`UnwiredGroupError`: no pairs to
        that group there, retryable; else ValueError), the request withdrawn and its prepare undone (the abort
        and release ride the next step; its pages are free at once, as no receive is posted for them)."""
        remote = self._remote.get(request_id)
        err = None if remote is None else self._errors.get(remote.transfer_id)
        if err is None:
            return
        del self._remote[request_id]
        self._abort(remote.transfer_id)
        self._release(remote.transfer_id)
        core.withdraw_remote(request_id)
        raise (UnwiredGroupError if err.kind == UnwiredGroupError.__name__ else ValueError)(err.message)

    def continue_remote(self, core: EngineCore, request_id: str, first_token: int,
                        first_logprobs: dict[int, float] | None = None) -> None:
        """The first token (sampled by the prefill engine) of an admitted request; it decodes on once its KV
        has landed. A request already decoding (its first token came with the KV) goes on as it is."""
        remote = self._remote.get(request_id)
        if remote is None and core.holds(request_id):
            return  # started when its KV landed
        if remote is None or remote.aborted:
            raise KeyError(f"request_id: {request_id!r} is not awaiting its KV here (unknown, failed or aborted)")
        if remote.first is None:  # one from the KV header stays (the same sample)
            remote.first = (int(first_token), first_logprobs)
            self.mark("first_known", request_id)

    def fail_remote(self, core: EngineCore, request_id: str, why: str) -> bool:
        """The request's KV will not come (its prefill reported the transfer failed): fail it now rather than
        at its lease. False when it is not awaiting its KV (unknown, landed, or failed/aborted before)."""
        remote = self._remote.get(request_id)
        if remote is None or remote.aborted or remote.landed:
            return False
        self._fail_remote(core, request_id, why)
        return True

    def abort(self, core: EngineCore, request_id: str) -> bool | None:
        remote = self._remote.get(request_id)
        if remote is None:
            return None
        if not remote.aborted:
            remote.aborted = True
            self._abort(remote.transfer_id)
        return True

    def pop_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of requests that failed for their KV since the last call."""
        out, self._failures = self._failures, []
        return out

    def _fail_remote(self, core: EngineCore, request_id: str, why: str) -> None:
        """The request's KV cannot come: abort it; its pages go once every shard's part settled, and it is
        reported (`pop_failures`) once the shards let it go."""
        remote = self._remote[request_id]
        if not remote.aborted:
            self._abort(remote.transfer_id)
        remote.aborted, remote.failure = True, why

    def _drop_remote(self, core: EngineCore, request_id: str) -> None:
        """Forget a remote request whose transfer settled; free its pages (abort or failure)."""
        remote = self._remote.pop(request_id)
        self._release(remote.transfer_id)
        core.abort_request(request_id, failure_reason=None if remote.failure is None else "transfer")
        self._dropped.append(request_id)
        if remote.failure is not None:
            self._releasing.append((request_id, remote.failure))

    def _watching(self) -> tuple[str, ...]:
        return tuple(r.transfer_id for r in self._remote.values())

    def absorb(self, events) -> None:
        super().absorb(events)
        if events is not None:  # the step that carried the releases queued before it ran
            self._failures += self._releasing
            self._releasing = []
        if events is not None and events.results:
            for r in self._remote.values():
                r.seen_since_abort = r.aborted

    def wants_step(self) -> bool:
        return super().wants_step() or any(r.landed and r.first is not None and not r.aborted
                                           for r in self._remote.values())

    def poll(self, core: EngineCore) -> tuple[list[EngineCoreOutput], list[str]]:
        """Start decoding a request whose KV landed and whose first token is known; fail one whose KV cannot
        come (transfer failed, or nothing within the lease); drop aborted ones once their transfer settled."""
        now = time.monotonic()
        lease = self.config.lease_s
        outputs: list[EngineCoreOutput] = []
        for rid, r in list(self._remote.items()):
            res = self._results.get(r.transfer_id)
            if r.aborted:
                # results from a step that ran the abort: settled means the wire lets go of the pages
                if res is not None and res.settled and r.seen_since_abort:
                    self._drop_remote(core, rid)
                continue
            if res is not None and res.state is TransferState.FAILED:
                self._fail_remote(core, rid, f"KV transfer failed: {res.reason}")
                continue
            if res is not None and res.state is TransferState.DONE and not r.landed:
                r.landed = True
                self.mark("landed", rid, res.marks)
                if r.first is None and r.first_from_kv and res.meta is not None:
                    r.first = first_token_from_meta(res.meta)
                    self.mark("first_known", rid)
            if r.landed and r.first is not None:
                outputs.extend(self._activate(core, rid, r))
            elif now - r.created > lease:
                why = "the first token never came" if r.landed else "no KV arrived"
                self._fail_remote(core, rid, f"lease expired after {lease:g} s: {why}")
        dropped, self._dropped = self._dropped, []
        return outputs, dropped

    def _activate(self, core: EngineCore, rid: str, r: _Remote) -> list[EngineCoreOutput]:
        del self._remote[rid]
        self.mark("activated", rid)
        self._release(r.transfer_id)
        token, logprobs = r.first
        return core.activate_remote(rid, token, logprobs)
