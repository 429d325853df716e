"""Engine roles in one process: a prefill engine and a decode engine (each its own model and KV pool) joined by
a real gloo pair, against a unified engine on the same checkpoint. Also every way a disaggregated request can
end early, with both pools checked to hold no page afterwards."""
from __future__ import annotations

import random
import time

import pytest
import torch

from tests.workers.disagg_helpers import drive_pair
from workers.config import EngineConfig
from workers.engine import Engine, role_engine_config
from workers.request import SamplingParams
from workers.kv.config import TransferConfig, TransferState
from workers.testing import hold_pages

# prompts past 64 tokens: the tiny model's sparse layers select 4 of up to 10 blocks
LENGTHS = [5, 17, 33, 64, 65, 90, 120, 150]
MAX_TOKENS = [6, 4, 8, 1, 7, 5, 8, 3]
P_GROUP, D_GROUP = "prefill-0#0", "decode-0#0"


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_model_len": 256, "num_pages": 64, "max_num_batched_tokens": 128, **kw})


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    """(prefill engine, decode engine) with one open gloo pair; short timeouts so failure cases stay fast."""
    torch.set_num_threads(1)
    cfg = TransferConfig(timeout_s=1.5, receive_timeout_s=30.0, lease_s=5.0, announce=True)
    prefill = Engine(tiny_ckpt, engine_config=engine_config(), role="prefill", transfer=cfg)
    decode = Engine(tiny_ckpt, engine_config=engine_config(), role="decode", transfer=cfg)
    connect(prefill, decode, 0)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def connect(prefill: Engine, decode: Engine, gen: int) -> None:
    listened = decode.agents[0].listen(f"prefill-0#{gen}", remote_tp=1)
    prefill.agents[0].connect(f"decode-0#{gen}", listened)
    prefill.agents[0].wait_ready(10)
    decode.agents[0].wait_ready(10)


def assert_empty(*engines: Engine) -> None:
    for e in engines:
        assert not e.has_unfinished(), f"{e.role}: requests left"
        st = e.stats()
        assert st.num_pages_free == st.num_pages_total, f"{e.role}: {st.num_pages_total - st.num_pages_free} pages held"
        assert e.pages.owners() == {}, e.role
        assert e.agents[0].end._ops == {}, f"{e.role}: transfer bookkeeping left"


def drive(prefill: Engine, decode: Engine, until, timeout: float = 30.0, on_first=None) -> dict:
    return drive_pair(prefill, decode, until, timeout=timeout, on_first=on_first)


def submit(prefill: Engine, decode: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    pages = decode.admit_remote(rid, prompt, params, group=P_GROUP)
    assert pages is not None
    prefill.add_request(rid, prompt, params, handoff_to=D_GROUP)
    return pages


def test_disaggregated_equals_unified(pair, tiny_ckpt):
    prefill, decode = pair
    params = [SamplingParams(temperature=0.0, max_tokens=k, logprobs=5, ignore_eos=True) for k in MAX_TOKENS]
    unified = Engine(tiny_ckpt, engine_config=engine_config(), role="unified")
    for i, (p, sp) in enumerate(zip(prompts(), params)):
        unified.add_request(f"u{i}", p, sp)
    want = {}
    while unified.has_unfinished():
        want.update({o.request_id[1:]: o for o in unified.step() if o.finished})

    ids = [str(i) for i in range(len(LENGTHS))]
    headers_before = sum(w.seq for w in prefill.agents[0].end._workers.values())
    for rid, p, sp in zip(ids, prompts(), params):
        if sp.max_tokens > 1:
            submit(prefill, decode, rid, p, sp)
        else:  # one token: prefill alone answers, nothing is reserved on decode
            prefill.add_request(rid, p, sp, handoff_to=D_GROUP)
    handed = [r for r, sp in zip(ids, params) if sp.max_tokens > 1]
    st = drive(prefill, decode, lambda s: set(s["out"]) >= set(handed) and len(s["outcomes"]) == len(handed))
    assert all(ok for ok, _ in st["outcomes"].values()), st["outcomes"]
    # the prompts that finish in one prefill step go as one payload (the first step finishes four prompts)
    assert sum(w.seq for w in prefill.agents[0].end._workers.values()) - headers_before < len(handed)
    for rid in ids:
        w = want[rid].outputs[0]
        first = st["first"][rid].outputs[0]
        assert first.token_ids == w.token_ids[:1]
        got = w if rid not in handed else st["out"][rid].outputs[0]
        assert got.token_ids == w.token_ids, f"request {rid} (prompt {LENGTHS[int(rid)]})"
        assert got.finish_reason == "length"
        assert got.text == w.text
        for a, b in zip(first.logprobs + got.logprobs[1:], w.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)
    stats = prefill.pop_transfer_stats()
    assert sorted(s.request_id for s in stats) == sorted(handed)
    assert all(s.ok and s.num_bytes > 0 and s.seconds > 0 for s in stats)
    # bytes = pages x (K + V per layer for 2 KV heads x 32 dims + index-K of the 3 sparse layers) x 16 tokens x 4 B
    per_page = 16 * 4 * (4 * 2 * 2 * 32 + 3 * 32)
    assert {s.request_id: s.num_bytes for s in stats} == {
        r: -(-LENGTHS[int(r)] // 16) * per_page for r in handed}
    roles = {s.role for s in decode.pop_request_stats()} | {s.role for s in prefill.pop_request_stats()}
    assert roles == {"prefill", "decode"}
    unified.shutdown()
    assert_empty(prefill, decode)


def test_prefill_engines_capture_no_decode_graphs(pair):
    """A prefill engine never runs a decode step: its shards run eager (no graph capture at startup)."""
    prefill, decode = pair
    assert prefill.engine_config.enforce_eager and not decode.engine_config.enforce_eager
    assert role_engine_config(decode.engine_config, "prefill").enforce_eager


def test_seeded_sampling_continues_on_decode(pair, tiny_ckpt):
    """The decode replica's generator for a seeded sample replays the prefill's draw of the first token, so a
    seeded sampled request gives what the unified engine gives, token for token."""
    prefill, decode = pair
    params = [SamplingParams(temperature=0.9, max_tokens=8, seed=7 + i, ignore_eos=True) for i in range(4)]
    ps = prompts(seed=5)[:4]
    unified = Engine(tiny_ckpt, engine_config=engine_config(), role="unified")
    for i, (p, sp) in enumerate(zip(ps, params)):
        unified.add_request(f"u{i}", p, sp)
    want = {}
    while unified.has_unfinished():
        want.update({o.request_id[1:]: o.outputs[0].token_ids for o in unified.step() if o.finished})
    unified.shutdown()
    ids = [f"s{i}" for i in range(4)]
    for rid, p, sp in zip(ids, ps, params):
        submit(prefill, decode, rid, p, sp)
    st = drive(prefill, decode, lambda s: set(s["out"]) >= set(ids) and len(s["outcomes"]) == len(ids))
    assert {rid: st["out"][rid].outputs[0].token_ids for rid in ids} == {f"s{i}": want[str(i)] for i in range(4)}
    assert_empty(prefill, decode)


def test_decode_starts_when_the_kv_lands(pair, tiny_ckpt):
    """The first token (and its logprobs) rides in the KV header: the decode engine starts when the pages land,
    with nobody handing it the token, and gives what the unified engine gives. A late `continue_remote` changes
    nothing; one admitted with `first_from_kv=False` (a retried prefill) waits for it."""
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    ps = prompts(seed=11)[4:7]
    unified = Engine(tiny_ckpt, engine_config=engine_config(), role="unified")
    for i, p in enumerate(ps):
        unified.add_request(f"k{i}", p, sp)
    want = {}
    while unified.has_unfinished():
        want.update({o.request_id: o.outputs[0] for o in unified.step() if o.finished})
    unified.shutdown()
    ids = [f"k{i}" for i in range(len(ps))]
    for rid, p in zip(ids, ps):
        submit(prefill, decode, rid, p, sp)
    late = []

    def started(s) -> bool:  # hand over one first token only after its request is decoding already
        running = [r for r in ids if decode.core.holds(r) and not decode.kv.holds(r)]
        if running and not late:
            late.append(running[0])
            first = s["first"][running[0]].outputs[0]
            decode.continue_remote(running[0], first.token_ids[0], first.logprobs[0])
        return set(s["out"]) >= set(ids) and len(s["outcomes"]) == len(ids)

    st = drive(prefill, decode, started, on_first=lambda o: False)
    assert late, "no request was seen decoding before the end"
    for rid in ids:
        got, w = st["out"][rid].outputs[0], want[rid]
        assert got.token_ids == w.token_ids and got.text == w.text
        for a, b in zip(got.logprobs, w.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)
    # the retry path: the KV lands, and the request waits for the token the client already has
    decode.admit_remote("k-wait", ps[0], sp, group=P_GROUP, first_from_kv=False)
    prefill.add_request("k-wait", ps[0], sp, handoff_to=D_GROUP)
    st = drive(prefill, decode, lambda s: "k-wait" in s["outcomes"], on_first=lambda o: False)
    assert st["outcomes"]["k-wait"] == (True, None)
    for _ in range(5):
        assert decode.step() == []  # landed, but not decoding
    decode.continue_remote("k-wait", want["k0"].token_ids[0], want["k0"].logprobs[0])
    st = drive(prefill, decode, lambda s: "k-wait" in s["out"])
    assert st["out"]["k-wait"].outputs[0].token_ids == want["k0"].token_ids
    assert_empty(prefill, decode)


def test_fail_remote_frees_a_reservation_at_once(pair):
    """The router learns from the prefill side that the KV will not come: the decode side fails the request now
    (its stream gets the reason), not when its lease runs out."""
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    decode.admit_remote("fr", prompts()[2], sp, group=P_GROUP)
    assert decode.fail_remote("fr", "KV transfer failed: peer_gone: injected") is True
    assert decode.pop_failures() == [("fr", "KV transfer failed: peer_gone: injected")]
    assert decode.fail_remote("fr", "again") is False and decode.fail_remote("nobody", "x") is False
    drive(prefill, decode, lambda s: not decode.has_unfinished())
    assert_empty(prefill, decode)


def test_abort_before_and_after_the_transfer(pair):
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    p = prompts()[5]
    # decode admitted, prefill never ran: the decode abort frees at once
    submit_decode_only = decode.admit_remote("a0", p, sp, group=P_GROUP)
    assert len(submit_decode_only) == -(-len(p) // 16)
    assert decode.stats().num_pages_free == decode.stats().num_pages_total - len(submit_decode_only)
    assert decode.abort_request("a0")
    assert_empty(decode)
    # KV landed on decode, first token never handed over (a retried prefill: the client left before it came)
    decode.admit_remote("a1", p, sp, group=P_GROUP, first_from_kv=False)
    prefill.add_request("a1", p, sp, handoff_to=D_GROUP)
    st = drive(prefill, decode, lambda s: "a1" in s["outcomes"], on_first=lambda o: False)
    assert st["outcomes"]["a1"] == (True, None)
    assert decode.stats().num_pages_free < decode.stats().num_pages_total
    assert decode.abort_request("a1") and prefill.abort_request("a1") is False
    drive(prefill, decode, lambda s: not decode.has_unfinished())
    assert_empty(prefill, decode)


def test_transfer_failures_free_both_sides(pair):
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    p = prompts()[4]
    # refused header: both ends fail, the pair stays usable
    prefill.agents[0].set_faults({"f0": "corrupt_header"})
    submit(prefill, decode, "f0", p, sp)
    st = drive(prefill, decode, lambda s: "f0" in s["outcomes"] and "f0" in s["failures"])
    ok, why = st["outcomes"]["f0"]
    assert not ok and "header mismatch" in why and "header mismatch" in st["failures"]["f0"]
    assert prefill.agents[0].broken(D_GROUP) is None
    # the sender dies before its header (peer gone): prefill fails at once; the decode side is aborted by the router
    prefill.agents[0].set_faults({"f1": "peer_gone"})
    submit(prefill, decode, "f1", p, sp)
    st = drive(prefill, decode, lambda s: "f1" in s["outcomes"])
    assert st["outcomes"]["f1"][0] is False and "peer_gone" in st["outcomes"]["f1"][1]
    # the router aborts the decode side; if the decode engine saw the pair break first (its waits watch the
    # header stream), it has failed the request itself already: either way the request ends there
    if not decode.abort_request("f1"):
        assert "f1" in st["failures"] or "f1" in dict(decode.pop_failures())
    assert prefill.agents[0].broken(D_GROUP)
    drive(prefill, decode, lambda s: not decode.has_unfinished())
    assert_empty(prefill, decode)
    # a new pair generation replaces the broken one; the sender goes silent mid-payload (dead prefill)
    for e, g in ((prefill, D_GROUP), (decode, P_GROUP)):
        e.agents[0].drop(g)
    connect(prefill, decode, 1)
    prefill.agents[0].set_faults({"f2": "drop_payload"})
    decode.admit_remote("f2", p, sp, group="prefill-0#1")
    prefill.add_request("f2", p, sp, handoff_to="decode-0#1")
    st = drive(prefill, decode, lambda s: "f2" in s["outcomes"] and "f2" in s["failures"])
    assert "timeout" in st["outcomes"]["f2"][1] and "timeout" in st["failures"]["f2"]
    prefill.agents[0].set_faults({})
    for e, g in ((prefill, "decode-0#1"), (decode, "prefill-0#1")):
        e.agents[0].drop(g)
    connect(prefill, decode, 0)
    assert_empty(prefill, decode)


def test_decode_pool_full_refuses_and_lease_frees(pair):
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    p = prompts()[6]
    hold_pages(decode, decode.pages.num_free_pages - 2)
    assert decode.admit_remote("full", p, sp, group=P_GROUP) is None  # no room: nothing reserved
    hold_pages(decode, 0)
    assert_empty(decode)
    # admitted, but neither KV nor first token ever comes: the lease frees the pages
    lease = dataclass_replace_lease(decode, 0.3)
    try:
        decode.admit_remote("lease", p, sp, group=P_GROUP)
        st = drive(prefill, decode, lambda s: "lease" in s["failures"], timeout=10)
        assert "lease expired" in st["failures"]["lease"] or "no KV arrived" in st["failures"]["lease"]
    finally:
        decode.transfer_config = lease
    assert_empty(decode)


def dataclass_replace_lease(engine: Engine, lease_s: float) -> TransferConfig:
    import dataclasses

    old = engine.transfer_config
    engine.transfer_config = dataclasses.replace(old, lease_s=lease_s)
    return old


def test_roles_refuse_what_they_cannot_do(pair, tiny_ckpt):
    prefill, decode = pair
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="^n:"):
        decode.admit_remote("n2", [5, 6, 7], SamplingParams(n=2, max_tokens=3), group=P_GROUP)
    with pytest.raises(ValueError, match="^group:"):
        decode.admit_remote("g", [5, 6, 7], sp, group="nobody#0")
    with pytest.raises(ValueError, match="^handoff_to:"):
        decode.add_request("h", [5, 6, 7], sp, handoff_to=D_GROUP)
    with pytest.raises(KeyError):
        decode.continue_remote("never-admitted", 5)
    assert_empty(prefill, decode)


def test_handoff_marks_on_both_sides(pair):
    """The marks bench_serving_pd's first -> second token split reads (EngineServer.debug_timeline): prefill
    send + settled (with the sender's transfer phases), decode admitted, first token known, KV landed (with the
    receiver's `landed`) and activated; wall clock, in causal order."""
    prefill, decode = pair
    since = time.time()
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    submit(prefill, decode, "mk", prompts()[3], sp)
    drive(prefill, decode, lambda s: "mk" in s["out"] and "mk" in s["outcomes"])
    pm = {kind: (t, ph) for t, kind, rid, ph in prefill.marks if rid == "mk" and t >= since}
    dm = {kind: (t, ph) for t, kind, rid, ph in decode.marks if rid == "mk" and t >= since}
    assert set(pm) == {"send", "settled"} and set(dm) == {"admitted", "first_known", "landed", "activated"}
    assert {"called", "acked"} <= set(pm["settled"][1]) and "landed" in dm["landed"][1]
    # order within one clock only: the phases were taken on time.monotonic() and shifted onto the wall clock
    assert pm["send"][0] <= pm["settled"][0] and pm["settled"][1]["called"] <= pm["settled"][1]["acked"]
    assert dm["admitted"][0] <= pm["send"][0] <= dm["landed"][0] <= dm["activated"][0]
    assert dm["first_known"][0] <= dm["activated"][0]
    # the header went ahead of the pages (announced before the prefill's forward): the receiver read it before
    # the sender was called to send them
    assert "announced" in pm["settled"][1] and dm["landed"][1]["header"] <= pm["settled"][1]["called"]
    assert_empty(prefill, decode)


def test_a_request_ended_by_its_first_token_after_its_header_went_ahead_is_withdrawn(pair):
    """Announced, then its first token is a stop token: its bytes go with the others' payload but count for
    nothing. Its decode reservation waits on (PENDING) until the router drops it; the other request lands and
    decodes; both pools and both transfer ledgers end empty."""
    prefill, decode = pair
    p, other = prompts()[5], prompts()[6]
    prefill.add_request("probe", p, SamplingParams(temperature=0.0, max_tokens=1))
    first = None
    while prefill.has_unfinished():
        first = next((o.outputs[0].token_ids[0] for o in prefill.step() if o.finished), first)
    sent_before = prefill.agents[0].end._workers[f"{D_GROUP}/0"].seq
    submit(prefill, decode, "w", p, SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=(first,)))
    submit(prefill, decode, "k", other, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    st = drive(prefill, decode, lambda s: "w" in s["first"] and "k" in s["out"] and "k" in s["outcomes"])
    assert st["first"]["w"].outputs[0].finish_reason == "stop" and "w" not in st["outcomes"]
    assert st["outcomes"]["k"] == (True, None) and len(st["out"]["k"].outputs[0].token_ids) == 3
    assert prefill.agents[0].end._workers[f"{D_GROUP}/0"].seq == sent_before + 1  # one payload for both
    assert decode.agents[0].end.result("w").state is TransferState.PENDING
    assert decode.abort_request("w")  # the router's part: the prefill answered alone
    drive(prefill, decode, lambda s: not (prefill.has_unfinished() or decode.has_unfinished()))
    assert_empty(prefill, decode)


def test_a_step_that_fails_after_announcing_fails_its_request_withdraws_and_keeps_the_pair(pair, monkeypatch):
    """The forward raises (a device error) after the step announced a request: that request alone fails (its
    output carries the error, its handoff is reported failed, its pages are freed at once) and the prefill
    engine serves on; the payload still goes, as withdrawn, so the pair stays in step; the decode side waits
    again until the router drops its reservation; the pair carries the next request."""
    prefill, decode = pair
    p = prompts()[4]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    submit(prefill, decode, "boom", p, sp)

    def broken(batch):
        raise RuntimeError("device error")

    monkeypatch.setattr(prefill.executor, "execute", broken)
    (out,) = prefill.step()
    monkeypatch.undo()
    assert out.request_id == "boom" and out.finished and out.outputs[0].finish_reason == "error"
    assert "RuntimeError: device error" in str(out.error) and not out.error.out_of_memory
    assert prefill.pop_transfer_outcomes() == [("boom", False, str(out.error))]
    assert not prefill.scheduler.has_unfinished() and not prefill.hands_off("boom")
    assert prefill.pages.num_free_pages == prefill.num_pages  # the withdrawn bytes count for nothing
    receiver = decode.agents[0].end
    deadline = time.monotonic() + 10
    while receiver.result("boom").state is not TransferState.PENDING or prefill.kv.has_withdrawn():
        assert time.monotonic() < deadline, receiver.result("boom")
        prefill.poll_transfers()
        time.sleep(0.01)
    assert not prefill.abort_request("boom")  # gone already
    assert decode.abort_request("boom")  # the router's part: the prefill answered with the error
    drive(prefill, decode, lambda s: not (prefill.has_unfinished() or decode.has_unfinished()))
    assert_empty(prefill, decode)
    submit(prefill, decode, "after-boom", p, sp)  # the pair carries the next one
    st = drive(prefill, decode, lambda s: "after-boom" in s["out"] and "after-boom" in s["outcomes"])
    assert st["outcomes"]["after-boom"] == (True, None) and len(st["out"]["after-boom"].outputs[0].token_ids) == 3
    assert_empty(prefill, decode)
