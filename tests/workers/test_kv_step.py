"""KV transfer rides the step (issue 19): the connector's commands go out in the `StepBatch`, the shards' events
come back in the `StepResult`, and no transfer agent is called per request outside a step.

Pure tests drive a `DecodeConnector` over a real `EngineCore` with hand-made events; the in-process tests join a
prefill and a decode engine by a real gloo pair (as tests/workers/test_engine_roles.py does) and spy on what
reaches their shards."""
from __future__ import annotations

import time

import pytest

from tests.workers.disagg_helpers import drive_pair
from tests.workers.test_core import make_core
from tests.workers.test_engine_roles import D_GROUP, P_GROUP, assert_empty, prompts
from tests.workers.test_engine_roles import pair  # noqa: F401 - the fixture: one gloo pair for this module
from workers.kv.commands import KVEvents, Prepare
from workers.kv.config import TransferConfig, TransferState
from workers.kv.connector import first_token_meta
from workers.kv.endpoint import TransferResult
from workers.kv.remote import DecodeConnector
from workers.request import SamplingParams


def _decode_core():
    core = make_core(num_pages=16, page_size=4)
    core.role = "decode"
    return core


def _result(tid: str, state: TransferState, *, meta: dict | None = None) -> TransferResult:
    return TransferResult(request_id=tid, state=state, settled=state.final, meta=meta)


# ---- the commands a step carries (pure: a connector, a core, no shards) ------------------------------------------
def test_decode_connector_commands_follow_the_request():
    core = _decode_core()
    kv = DecodeConnector(["an agent"], role="decode", config=TransferConfig())
    assert kv.take_commands() is None  # nothing admitted: a step carries no KV commands
    kv.admit_remote(core, "r", list(range(3, 13)), SamplingParams(max_tokens=3), group="p#0", transfer_id="t")
    pages = tuple(core.pages.page_table(core.scheduler.requests["r"].seqs[0].seq_id))
    cmds = kv.take_commands()
    assert cmds.prepare == (Prepare("t", pages, "p#0"),) and cmds.watch == ("t",)
    assert not cmds.release and not cmds.abort and not cmds.send
    again = kv.take_commands()  # a command goes out once; the transfer stays watched until it settles
    assert again.prepare == () and again.watch == ("t",) and not again.changes
    # the step's events: the KV landed with the first token in its header -> the request starts decoding
    outputs, dropped = kv.on_events(core, KVEvents(results={"t": _result("t", TransferState.DONE,
                                                                           meta=first_token_meta(7, None))}))
    assert [o.new_token_ids for o in outputs] == [[7]] and dropped == []
    cmds = kv.take_commands()
    assert cmds.release == ("t",) and cmds.watch == ()  # the shards forget it in the next step


def test_decode_abort_goes_out_in_a_step_and_frees_once_settled():
    core = _decode_core()
    kv = DecodeConnector(["an agent"], role="decode", config=TransferConfig())
    free = core.pages.num_free_pages
    kv.admit_remote(core, "r", list(range(3, 13)), SamplingParams(max_tokens=3), group="p#0")
    kv.take_commands()
    kv.on_events(core, KVEvents(results={"r": _result("r", TransferState.TRANSFERRING)}))
    assert kv.abort(core, "r") is True
    assert kv.take_commands().abort == ("r",)
    # results of a step that had not run the abort yet do not free the pages, even when settled
    assert core.pages.num_free_pages < free
    _out, dropped = kv.on_events(core, KVEvents(results={"r": _result("r", TransferState.FAILED)}))
    assert dropped == ["r"] and core.pages.num_free_pages == free
    assert kv.take_commands().release == ("r",)
    assert not kv.has_pending() and not kv.has_commands() and kv.pop_failures() == []  # aborted, not failed


def test_decode_failure_is_reported_once_released():
    """A transfer that failed: the abort goes out, the pages go once settled, and the failure is reported only
    after the step that released it ran (nothing of the request left on any shard)."""
    core = _decode_core()
    kv = DecodeConnector(["an agent"], role="decode", config=TransferConfig())
    kv.admit_remote(core, "r", list(range(3, 13)), SamplingParams(max_tokens=3), group="p#0")
    kv.take_commands()
    kv.on_events(core, KVEvents(results={"r": _result("r", TransferState.FAILED)}))
    assert kv.take_commands().abort == ("r",) and kv.pop_failures() == []
    _out, dropped = kv.on_events(core, KVEvents(results={"r": _result("r", TransferState.FAILED)}))
    assert dropped == ["r"] and kv.take_commands().release == ("r",)
    assert kv.has_pending() and kv.pop_failures() == []  # until the step that releases it ran
    kv.absorb(KVEvents())
    assert not kv.has_pending() and [rid for rid, _why in kv.pop_failures()] == ["r"]


def test_decode_command_error_fails_the_request():
    """A shard that could not prepare reports it in the step's events: the admission raises (the engine runs
    that step before it returns), the request is withdrawn, its prepare undone on the others."""
    from workers.kv.agent import UnwiredGroupError
    from workers.kv.commands import CommandError

    core = _decode_core()
    kv = DecodeConnector(["an agent"], role="decode", config=TransferConfig())
    free = core.pages.num_free_pages
    kv.admit_remote(core, "r", list(range(3, 13)), SamplingParams(max_tokens=3), group="gone#0")
    kv.take_commands(watch=False)
    kv.absorb(KVEvents(errors={"r": CommandError("UnwiredGroupError", "group: no pairs to 'gone#0'")}))
    with pytest.raises(UnwiredGroupError, match="gone#0"):
        kv.check_admitted(core, "r")
    assert core.pages.num_free_pages == free and not kv.holds("r")
    cmds = kv.take_commands()
    assert cmds.abort == ("r",) and cmds.release == ("r",)


# ---- in process: a real pair (test_engine_roles' fixture), spied on ------------------------------------------
_PER_REQUEST = ("prepare", "send_many", "announce", "release", "abort", "result", "results")


@pytest.fixture
def spied(pair, monkeypatch):
    """Every per-request agent call of both engines, recorded as (engine role, method, inside a step?)."""
    calls: list[tuple[str, str, bool]] = []
    for engine in pair:
        agent, worker = engine.agents[0], engine.executor.kv_worker
        for name in _PER_REQUEST:
            real = getattr(agent, name)

            def spy(*args, _real=real, _name=name, _role=engine.role, _worker=worker, **kwargs):
                calls.append((_role, _name, _worker.in_step))
                return _real(*args, **kwargs)

            monkeypatch.setattr(agent, name, spy)
    return calls


def test_no_agent_call_outside_a_step(pair, spied):
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts()[:3]):
        decode.admit_remote(f"s{i}", p, sp, group=P_GROUP)
        prefill.add_request(f"s{i}", p, sp, handoff_to=D_GROUP)
    decode.admit_remote("s-abort", prompts()[4], sp, group=P_GROUP)
    decode.abort_request("s-abort")
    st = drive_pair(prefill, decode, lambda s: len(s["out"]) == 3 and len(s["outcomes"]) == 3
                    and not prefill.has_unfinished() and not decode.has_unfinished())
    assert all(ok for ok, _why in st["outcomes"].values())
    kinds = {(role, name) for role, name, _inside in spied}
    for want in [("decode", "prepare"), ("prefill", "send_many"), ("prefill", "release"), ("decode", "release"),
                 ("decode", "abort"), ("prefill", "result"), ("decode", "result")]:
        assert want in kinds, f"{want} never called: {sorted(kinds)}"
    outside = [(role, name) for role, name, inside in spied if not inside]
    assert outside == [], f"agent calls outside a step: {outside}"
    assert_empty(prefill, decode)


def test_kv_only_step_moves_a_pending_transfer_on(pair, monkeypatch):
    """The decode engine has nothing to compute while the KV travels: its step is a KV-only batch (no rows), and
    the one whose events show the KV landed starts the request decoding."""
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    p = prompts()[5]
    decode.admit_remote("k", p, sp, group=P_GROUP)
    prefill.add_request("k", p, sp, handoff_to=D_GROUP)
    ran: list = []
    real = decode.executor.execute
    monkeypatch.setattr(decode.executor, "execute", lambda b: ran.append(b) or real(b))
    deadline = time.monotonic() + 30.0  # a bound against hanging, not a timing check
    while prefill.has_unfinished():  # prefill, handoff, send (a KV-only step), settle
        assert time.monotonic() < deadline, "the prefill's transfer never settled"
        prefill.step()
    assert not decode.core.has_unfinished() and decode.has_pending_transfers()
    first = []
    while not first:
        assert time.monotonic() < deadline, "the decode side never started the request"
        first = decode.step()
    assert first[0].request_id == "k" and len(first[0].outputs[0].token_ids) == 1
    kv_only = [b for b in ran if not b.chunks]
    assert kv_only and all(b.kv is not None and "k" in b.kv.watch and not b.rows for b in kv_only)
    while decode.has_unfinished():
        decode.step()
    assert_empty(prefill, decode)
