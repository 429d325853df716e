"""`PrefillConnector`: a prefill engine core's requests that hand their KV to a decode group.

A request added with a handoff runs its prompt and samples its first token; if that token does not end it, the
scheduler finishes it with reason "handoff" and keeps its pages. Then this connector sends them (one payload per
decode group and pair for all the step's handoffs) and frees them once the transfer settled or its lease
expired. With `TransferConfig.announce` the headers of the requests whose prompt completes in a step go out
before that step's forward; one whose first token ends it after all is sent as withdrawn.

Nothing here calls an agent: announces ride the step they are made for, sends the step after the one that
sampled the first token (before its forward; a KV-only step when nothing else runs), and aborts and releases
the next step; each step's results of the sent transfers come back in its `KVEvents` (`poll` reads them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from workers.core import EngineCore, EngineCoreOutput
from workers.kv.commands import Announce, Send
from workers.kv.config import TransferState
from workers.kv.connector import KVConnector, first_token_meta
from workers.request import RequestOutput


@dataclass(eq=False, kw_only=True)
class _Handoff:
    """A request whose pages go to a decode group once its first token exists."""

    seq_id: int
    transfer_id: str
    group: str
    created: float
    sent: bool = False
    aborted: bool = False
    aborting: bool = False  # an abort is on its way to the shards (sent once)


class PrefillConnector(KVConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._handoffs: dict[str, _Handoff] = {}
        self._to_send: list[tuple[str, list[int], dict]] = []  # handed off in this step: (request id, pages, meta)
        # announced before this step's forward (TransferConfig.announce): request id -> (transfer id, group)
        self._announced: dict[str, tuple[str, str]] = {}
        # announced, then ended by their first token: transfer id -> (group, seq id whose pages it reads, or None)
        self._to_withdraw: dict[str, tuple[str, int | None]] = {}
        self._withdrawn: dict[str, tuple[int | None, float]] = {}  # sent withdrawn: transfer id -> (seq id, when)
        self._outcomes: list[tuple[str, bool, str | None]] = []  # (request id, transfer ok, reason)
        self._aborting: set[str] = set()  # withdrawn transfers whose abort went out
        # settled, their release queued: reported (`pop_transfer_outcomes`) once the step that releases them ran,
        # so an outcome means the shards have forgotten the transfer
        self._releasing: list[tuple[str, bool, str | None]] = []

    def add_handoff(self, request_id: str, seq_id: int, *, transfer_id: str, group: str) -> None:
        """The request (sequence `seq_id`) sends its KV to decode group `group` after its first token."""
        self._handoffs[request_id] = _Handoff(seq_id=seq_id, transfer_id=transfer_id, group=group,
                                              created=time.monotonic())

    def holds(self, request_id: str) -> bool:
        return request_id in self._handoffs

    def request_ids(self) -> list[str]:
        return list(self._handoffs)

    def has_pending(self) -> bool:
        return bool(self._handoffs or self._withdrawn or self._releasing)

    def has_withdrawn(self) -> bool:
        """Withdrawn transfers whose pages are not free yet."""
        return bool(self._withdrawn)

    def abort(self, core: EngineCore, request_id: str) -> bool | None:
        handoff = self._handoffs.get(request_id)
        if handoff is not None and handoff.sent:  # its pages go once the transfer settled (poll)
            handoff.aborted = True
            self._abort_once(handoff)
            return True
        if self._handoffs.pop(request_id, None) is not None:
            self._outcomes.append((request_id, False, "aborted"))
        return None  # still on the core: the core frees it

    def on_step_failed(self, request_id: str, reason: str) -> None:
        if self._handoffs.pop(request_id, None) is not None:
            self._outcomes.append((request_id, False, reason))

    def pop_transfer_outcomes(self) -> list[tuple[str, bool, str | None]]:
        """(request id, ok, reason) of every handed-off request whose transfer settled."""
        out, self._outcomes = self._outcomes, []
        return out

    # ---- the step ---------------------------------------------------------------------------------------
    def absorb(self, events) -> None:
        if events is not None:  # the step that carried the releases queued before it ran
            self._outcomes += self._releasing
            self._releasing = []
        super().absorb(events)

    def _watching(self) -> tuple[str, ...]:
        return (*(h.transfer_id for h in self._handoffs.values() if h.sent), *self._withdrawn)

    def _abort_once(self, handoff: _Handoff) -> None:
        if not handoff.aborting:
            handoff.aborting = True
            self._abort(handoff.transfer_id)

    def poll(self, core: EngineCore) -> tuple[list[EngineCoreOutput], list[str]]:
        """Free the pages of handed-off requests whose transfer settled (the latest step's results), and abort
        those past their lease (their pages go once the wire lets go)."""
        now = time.monotonic()
        lease = self.config.lease_s
        self._settle_withdrawn(core, now - lease)
        for rid, h in list(self._handoffs.items()):
            res = self._results.get(h.transfer_id) if h.sent else None
            if res is None:
                continue
            if res.settled:
                self._release(h.transfer_id)
                del self._handoffs[rid]
                core.free_pages(h.seq_id)
                ok = res.state is TransferState.DONE
                err = self._errors.get(h.transfer_id)
                reason = f"not sent: {err.message}" if err is not None else res.reason or "failed"
                self._releasing.append((rid, ok, None if ok else reason))
                self.mark("settled", rid, res.marks)
            elif res.state is TransferState.FAILED or now - h.created > lease:
                self._abort_once(h)  # a shard failed it (the others stop too), or its lease ran out
        return [], []

    def _settle_withdrawn(self, core: EngineCore, stale: float) -> None:
        """Free the pages of withdrawn transfers once their bytes left (or at the lease)."""
        for tid, (seq_id, since) in list(self._withdrawn.items()):
            res = self._results.get(tid)
            if res is None or not res.settled:
                if res is not None and since < stale and tid not in self._aborting:
                    self._aborting.add(tid)
                    self._abort(tid)
                continue
            self._aborting.discard(tid)
            self._release(tid)
            del self._withdrawn[tid]
            if seq_id is not None:
                core.free_pages(seq_id)

    def on_schedule(self, core: EngineCore) -> None:
        """The requests whose prompt completes in this step (their first token is sampled in it) have their KV
        header sent in this step, before the forward, so the decode side posts its receives while this step
        computes (`TransferConfig.announce`; engines over worker groups (agents without `announce`) send after
        the step)."""
        if not self.config.announce or not self._handoffs or core.scheduled is None:
            return
        if not all(hasattr(agent, "announce") for agent in self.agents):
            return
        by_group: dict[str, list] = {}
        for c in core.scheduled.chunks:
            h = self._handoffs.get(c.seq.request.request_id) if c.sample and not c.is_decode else None
            if h is None or h.sent:
                continue
            ids = core.pages.page_table(c.seq.seq_id)[:core.pages.pages_for(c.seq.num_prompt_tokens)]
            by_group.setdefault(h.group, []).append((c.seq.request.request_id, h.transfer_id, list(ids)))
        for group, items in by_group.items():
            # a group without pairs on a shard: nothing goes ahead there, and the send that follows reports it
            self._out.announce.append(Announce(group, tuple((tid, tuple(ids)) for _rid, tid, ids in items)))
            for rid, tid, _ids in items:
                self._announced[rid] = (tid, group)

    def on_finished(self, core: EngineCore, out: RequestOutput) -> None:
        """The request's first token is out: queue its pages for the send, or (a stop ended it at that token)
        free them, or send its announced header as withdrawn."""
        handoff = self._handoffs.get(out.request_id)
        if handoff is None:
            return
        first = out.outputs[0]
        if first.finish_reason is not None:  # the first token ended it (stop string, EOS): nothing to send
            del self._handoffs[out.request_id]
            announced = self._announced.pop(out.request_id, None)
            if announced is None:
                core.free_pages(handoff.seq_id)
            else:  # its header went ahead: its bytes still go (withdrawn), read from its pages until settled
                self._to_withdraw[announced[0]] = (announced[1], handoff.seq_id)
            return
        page_ids = core.pages.page_table(handoff.seq_id)[:core.pages.pages_for(len(out.prompt_token_ids))]
        meta = first_token_meta(first.token_ids[0], first.logprobs[0] if first.logprobs else None)
        self._to_send.append((out.request_id, page_ids, meta))

    def after_step(self, core: EngineCore) -> None:
        """Send the KV of the requests this step handed off: one payload per decode group and pair for all of
        them (one transfer's fixed costs instead of one per request, which would queue on the pair). Requests
        announced and then ended by their first token go as withdrawn in the same call, and so does any other
        announced request not handed off (a step that failed: its pages stay with the request)."""
        if not (self._to_send or self._to_withdraw or self._announced):
            return  # the common step (decode, or no prompt finished)
        sending = {rid for rid, _ids, _meta in self._to_send}
        for rid, (tid, group) in self._announced.items():
            if rid not in sending:
                self._to_withdraw[tid] = (group, None)
        by_group: dict[str, tuple[list, list]] = {}
        for rid, page_ids, meta in self._to_send:
            by_group.setdefault(self._handoffs[rid].group, ([], []))[0].append((rid, page_ids, meta))
        for tid, (group, _seq_id) in self._to_withdraw.items():
            by_group.setdefault(group, ([], []))[1].append(tid)
        to_withdraw, self._to_send, self._to_withdraw, self._announced = self._to_withdraw, [], {}, {}
        now = time.monotonic()
        for tid in to_withdraw:
            self._withdrawn[tid] = (to_withdraw[tid][1], now)
        for group, (items, withdrawn) in by_group.items():
            self._send_group(core, group, items, withdrawn)

    def _send_group(self, core: EngineCore, group: str, items: list, withdrawn: list[str]) -> None:
        """Queue one payload per pair for the next step; the lease runs from now. A shard that cannot send (no
        pairs to `group` there) reports it in the step's events: the transfer reads FAILED and its pages go
        once every shard's part settled (`poll`)."""
        for rid, _ids, _meta in items:
            self.mark("send", rid)
        self._out.send.append(Send(group, tuple((self._handoffs[rid].transfer_id, tuple(ids), meta)
                                                for rid, ids, meta in items), tuple(withdrawn)))
        now = time.monotonic()
        for rid, _ids, _meta in items:
            self._handoffs[rid].sent = True
            self._handoffs[rid].created = now  # the lease runs from the send
