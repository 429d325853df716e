"""Async scheduling (EngineConfig.async_scheduling) on the tiny checkpoint, fp32 on the CPU: the same tokens and
logprobs as the synchronous engine across arrivals over time, every finish (stop ids, stop strings, length),
n > 1, seeded sampling, penalties (which keep the synchronous step), prompt logprobs, preemption under a small
pool, chunked prefill beside decoding and aborts while a step is in flight; the pool all free at the end. The
overlap itself is shown by recording the order of launches and result reads (no timing)."""
from __future__ import annotations

import random

import pytest

from workers.config import EngineConfig
from workers.engine import Engine
from workers.executor import LocalExecutor
from workers.request import SamplingParams
from workers.scheduler import PENDING_TOKEN


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


class RecordingExecutor(LocalExecutor):
    """The in-process executor, logging ("launch", step) and ("result", step) in the order they happen."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.log: list[tuple[str, int]] = []
        self.batches = []

    def launch(self, batch):
        n = len(self.batches)
        self.batches.append(batch)
        self.log.append(("launch", n))
        handle = super().launch(batch)
        log = self.log

        class Handle:
            def result(self):
                log.append(("result", n))
                return handle.result()

        return Handle()


def run(ckpt, async_scheduling: bool, arrivals: dict[int, list], aborts: dict[int, list[str]] | None = None,
        executor=None, **config):
    """Step an engine to the end: `arrivals[s]` = [(request id, prompt, params)] added before step s,
    `aborts[s]` = request ids aborted before step s. -> ({request id: [(tokens, logprobs, finish)] per sample},
    {request id: prompt logprobs}, the engine's stats at the end)."""
    cfg = EngineConfig(async_scheduling=async_scheduling, **config)
    eng = Engine(ckpt, engine_config=cfg, executor=executor(ckpt, engine_config=cfg, device="cpu")
                 if executor else "auto")
    aborts = aborts or {}
    last: dict = {}
    step = 0
    try:
        while step <= max(arrivals) or eng.has_unfinished():
            for rid, prompt, params in arrivals.get(step, []):
                eng.add_request(rid, prompt, params)
            for rid in aborts.get(step, []):
                eng.abort_request(rid)
            for out in eng.step():
                last[out.request_id] = out
            step += 1
            assert step < 500, "the engine did not finish"
        stats = eng.stats()
        assert stats.num_pages_free == stats.num_pages_total, "pages leaked"
        assert eng.pages.owners() == {}
        assert all(PENDING_TOKEN not in s.token_ids for r in eng.scheduler.requests.values() for s in r.seqs)
    finally:
        eng.shutdown()
    outs = {rid: [(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for rid, o in last.items()}
    plps = {rid: o.prompt_logprobs for rid, o in last.items()}
    return outs, plps, stats, eng


def flat(dicts) -> list[float]:
    return [v for d in dicts for v in d.values()]


def assert_same(got: dict, want: dict) -> None:
    """Tokens, finishes and logprob keys exactly; logprob values to fp32 rounding: the two engines batch the
    same rows with different neighbours (a request added between steps lands one step later in the synchronous
    engine), and a matmul's sums over a different batch round differently (~1e-6)."""
    assert got.keys() == want.keys()
    for rid in want:
        assert [(t, f) for t, _, f in got[rid]] == [(t, f) for t, _, f in want[rid]], rid
        for (_, g, _), (_, w, _) in zip(got[rid], want[rid]):
            if w is None:
                assert g is None
                continue
            assert [d.keys() for d in g] == [d.keys() for d in w], rid
            assert flat(g) == pytest.approx(flat(w), abs=1e-4), rid


def assert_same_prompt_logprobs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        if w is None:
            assert got[rid] is None
            continue
        assert [d and d.keys() for d in got[rid]] == [d and d.keys() for d in w]
        assert flat(got[rid][1:]) == pytest.approx(flat(w[1:]), abs=1e-4)


def both(ckpt, arrivals, aborts=None, **config):
    sync = run(ckpt, False, arrivals, aborts, **config)
    asyn = run(ckpt, True, arrivals, aborts, executor=RecordingExecutor, **config)
    return sync, asyn


def test_arrivals_over_time_finishes_n_seeded_and_logprobs_match_sync(tiny_ckpt):
    ref, _, _, _ = run(tiny_ckpt, False, {0: [("probe", ids(21, 9), greedy(12))]})
    probe = ref["probe"][0][0]
    stop_id = probe[5]  # a stop id the greedy run meets (the EOS check is the same code path)
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=11, n=2, max_tokens=9, ignore_eos=True, logprobs=2)
    arrivals = {
        0: [("a", ids(5, 1), greedy(14, logprobs=3)), ("b", ids(33, 2), greedy(3))],
        1: [("c", ids(17, 3), greedy(8, n=3, logprobs=1))],
        3: [("stop", ids(21, 9), greedy(12, stop_token_ids=(stop_id,))), ("seeded", ids(12, 4), seeded)],
        4: [("pen", ids(9, 5), SamplingParams(temperature=0.0, max_tokens=7, presence_penalty=0.8,
                                               repetition_penalty=1.3, ignore_eos=True))],
        6: [("plp", ids(26, 6), greedy(4, prompt_logprobs=2)), ("one", ids(3, 7), greedy(1))],
        9: [("late", ids(40, 8), greedy(10, logprobs=2))],
    }
    (s_out, s_plp, _, _), (a_out, a_plp, _, eng) = both(tiny_ckpt, arrivals, num_pages=64)
    assert_same(a_out, s_out)
    assert_same_prompt_logprobs(a_plp, s_plp)
    assert s_out["stop"][0][2] == "stop" and s_out["stop"][0][0] == probe[:probe.index(stop_id) + 1]
    assert s_out["a"][0][2] == "length" and len(s_out["a"][0][0]) == 14
    assert len(s_out["seeded"]) == 2 and s_out["seeded"][0][0] != s_out["seeded"][1][0]
    assert s_plp["plp"] is not None and len(s_plp["plp"]) == 26
    # the async engine did run steps ahead: some batch took input ids from the previous step on the device
    assert any(b.deferred_positions for b in eng.executor.batches)


def test_preemption_and_chunked_prefill_match_sync(tiny_ckpt):
    # 14 pages of 16 tokens: four requests of up to 5 pages each cannot all stay; 16-token step budget: the
    # 40-token prompts arriving later are prefilled in chunks beside the decode rows
    arrivals = {0: [(f"r{i}", ids(20 + 3 * i, i), greedy(40, logprobs=1)) for i in range(3)],
                5: [("long1", ids(40, 7), greedy(20))], 8: [("long2", ids(40, 8), greedy(24, n=2))]}
    (s_out, _, s_stats, _), (a_out, _, a_stats, eng) = both(tiny_ckpt, arrivals, num_pages=14,
                                                            max_num_batched_tokens=16, max_model_len=128)
    assert s_stats.num_preemptions > 0 and a_stats.num_preemptions > 0
    assert any(0 < b.num_tokens - len(b.deferred_positions) and b.deferred_positions and
               any(not c.is_decode for c in b.chunks) for b in eng.executor.batches), \
        "no step ahead held a prefill chunk beside deferred decode rows"
    assert_same(a_out, s_out)


def test_aborts_while_a_step_is_in_flight(tiny_ckpt):
    arrivals = {0: [("keep", ids(11, 1), greedy(16, logprobs=2)), ("gone", ids(13, 2), greedy(30)),
                    ("gone_n", ids(9, 3), greedy(30, n=2))],
                2: [("early", ids(7, 4), greedy(30))]}
    aborts = {4: ["gone", "early"], 7: ["gone_n"]}
    (s_out, _, _, _), (a_out, _, _, eng) = both(tiny_ckpt, arrivals, aborts, num_pages=64)
    assert_same({"keep": a_out["keep"]}, {"keep": s_out["keep"]})
    assert len(s_out["keep"][0][0]) == 16 and len(s_out["gone"][0][0]) < 30
    # an aborted request got as far as the step count allowed, which may differ by a step (a request added
    # between steps is scheduled one step later by the synchronous engine; samples 1.. of n > 1 start a step
    # after sample 0's first token is read back): the shorter run's tokens begin the longer's
    for rid in ("gone", "early", "gone_n"):
        assert len(a_out[rid]) == len(s_out[rid])
        for (a, _, _), (b, _, _) in zip(a_out[rid], s_out[rid]):
            assert a[:len(b)] == b[:len(a)] and min(len(a), len(b)) > 0, rid
    # the abort came while the aborted request's next step was already launched
    log = eng.executor.log
    assert log.index(("launch", 5)) < log.index(("result", 4))


def test_stop_strings_from_outside_match_sync(make_llm):
    prompt = {"prompt_token_ids": ids(25, 3)}
    full = make_llm(num_pages=64).generate(prompt, greedy(24))[0].outputs[0]
    stop = next(full.text[a:a + 2] for a in range(3, len(full.text) - 2)
                if "\ufffd" not in full.text[a:a + 2] and full.text.find(full.text[a:a + 2]) == a
                and not full.text[a:a + 2].isspace())
    params = [greedy(24, stop=(stop,)), greedy(24, n=2, stop=(stop,), logprobs=1), greedy(20)]
    prompts = [prompt, prompt, {"prompt_token_ids": ids(8, 4)}]
    outs = {a: make_llm(num_pages=64, async_scheduling=a).generate(prompts, params) for a in (False, True)}
    flat = {a: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in v for c in o.outputs]
            for a, v in outs.items()}
    assert flat[True] == flat[False]
    assert_same({i: [(c.token_ids, c.logprobs, c.finish_reason)] for i, c in
                 enumerate(c for o in outs[True] for c in o.outputs)},
                {i: [(c.token_ids, c.logprobs, c.finish_reason)] for i, c in
                 enumerate(c for o in outs[False] for c in o.outputs)})
    assert flat[True][0][2] == "stop" and flat[True][0][3] == stop and flat[True][0][1] == full.text[:full.text.find(stop)]


def test_steps_overlap_and_host_token_rows_stay_synchronous(tiny_ckpt):
    """With only plain requests, step n+1 is launched before step n's result is read; while a request with a
    penalty is in flight (its rows need its tokens on the host), every launch waits for the previous result."""
    cfg = EngineConfig(async_scheduling=True, num_pages=64)
    eng = Engine(tiny_ckpt, engine_config=cfg, executor=RecordingExecutor(tiny_ckpt, engine_config=cfg, device="cpu"))
    log = eng.executor.log
    try:
        eng.add_request("plain", ids(9, 1), greedy(6))
        while eng.has_unfinished():
            eng.step()
        plain = list(log)
        assert ("launch", 1) in plain and plain.index(("launch", 1)) < plain.index(("result", 0))
        assert all(plain.index(("launch", k + 1)) < plain.index(("result", k)) for k in range(4))
        stats = eng.pop_step_stats()
        assert len(stats) == 6 and all(0 <= s.host_overhead <= s.step_time for s in stats)
        del log[:]
        eng.add_request("pen", ids(9, 1), SamplingParams(temperature=0.0, max_tokens=6, frequency_penalty=0.5,
                                                          ignore_eos=True))
        base = len(eng.executor.batches)
        while eng.has_unfinished():
            eng.step()
        steps = range(base, len(eng.executor.batches))
        assert len(steps) == 6
        assert all(log.index(("result", k)) < log.index(("launch", k + 1)) for k in steps[:-1])
        assert not any(eng.executor.batches[k].deferred_positions for k in steps)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_disaggregated_roles_keep_the_synchronous_step(tiny_ckpt, role):
    """A KV handoff or a remote decode is bound to its step: those engines never launch a step ahead (they run
    every step through the executor's synchronous `execute`), with the same tokens."""
    want, _, _, _ = run(tiny_ckpt, False, {0: [("r", ids(10, 1), greedy(5))]}, num_pages=32)
    cfg = EngineConfig(async_scheduling=True, num_pages=32)
    eng = Engine(tiny_ckpt, engine_config=cfg, role=role,
                 executor=RecordingExecutor(tiny_ckpt, engine_config=cfg, device="cpu"))
    try:
        eng.add_request("r", ids(10, 1), greedy(5))
        last = None
        while eng.has_unfinished():
            last = next(iter(eng.step()), last)
        assert eng.executor.log == [] and len(eng.executor.batches) == 0
        assert_same({"r": [(c.token_ids, c.logprobs, c.finish_reason) for c in last.outputs]}, want)
    finally:
        eng.shutdown()


class FailingLaunches(LocalExecutor):
    """Test-only: the in-process executor whose launch (`where="launch"`) or result (`where="result"`) raises an
    out-of-memory error for the first batch holding a decode row of `seq_id` at position `start`."""

    def __init__(self, *args, seq_start: tuple[int, int], where: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.seq_start, self.where, self.failed = seq_start, where, []

    def launch(self, batch):
        from workers.memory import StepOutOfMemoryError

        seq_id, start = self.seq_start
        hit = not self.failed and any(r.seq_id == seq_id and batch.chunks[ci].start == start
                                      for r, ci in zip(batch.rows, batch.sample_chunks))
        if hit:
            self.failed.append(batch)
            if self.where == "launch":
                raise StepOutOfMemoryError("out of cuda memory (injected)")
        handle = super().launch(batch)
        if not hit:
            return handle

        class Failing:
            def result(self):
                handle.result()
                raise StepOutOfMemoryError("out of cuda memory (injected, read back)")

        return Failing()


@pytest.mark.parametrize("where", ["launch", "result"])
def test_a_failed_step_ahead_fails_only_its_requests(tiny_ckpt, where):
    """The step of "bad"'s 4th decode row raises in its launch (a step launched ahead: the step before it is
    updated first) or when its result is read: the requests in that step ("bad", "ok") end with the error; the
    one queued behind them (max_num_seqs = 2) and one sent afterwards run to the synchronous engine's tokens; the
    pool is all free."""
    arrivals = {0: [("bad", ids(10, 1), greedy(12)), ("ok", ids(12, 2), greedy(12, logprobs=1)),
                    ("queued", ids(9, 4), greedy(6, logprobs=1))],
                9: [("later", ids(7, 3), greedy(6))]}
    want, _, _, _ = run(tiny_ckpt, False, arrivals, num_pages=64, max_num_seqs=2)
    cfg = EngineConfig(async_scheduling=True, num_pages=64, max_num_seqs=2)
    ex = FailingLaunches(tiny_ckpt, engine_config=cfg, device="cpu", seq_start=(0, 10 + 3), where=where)
    eng = Engine(tiny_ckpt, engine_config=cfg, executor=ex)
    last, step = {}, 0
    try:
        while step <= 9 or eng.has_unfinished():
            for rid, prompt, params in arrivals.get(step, []):
                eng.add_request(rid, prompt, params)
            for out in eng.step():
                last[out.request_id] = out
            step += 1
        assert eng.stats().num_pages_free == eng.num_pages and eng.pages.owners() == {}
    finally:
        eng.shutdown()
    assert ex.failed and (ex.failed[0].deferred_positions or where == "result")
    for rid in ("bad", "ok"):
        out = last[rid]
        assert out.error is not None and "out of" in str(out.error) and out.outputs[0].finish_reason == "error"
        assert out.outputs[0].token_ids == want[rid][0][0][:len(out.outputs[0].token_ids)]
    got = {rid: [(c.token_ids, c.logprobs, c.finish_reason) for c in last[rid].outputs] for rid in ("queued", "later")}
    assert_same(got, {rid: want[rid] for rid in ("queued", "later")})


def test_the_default_switch_is_off_on_the_cpu_and_an_explicit_one_is_kept(tiny_ckpt):
    """EngineConfig.async_scheduling None (the default) resolves by the shard's device: off on the CPU (the launch
    runs the forward there; tests that count progress per step() see the synchronous step); True stays True."""
    from workers.configio import from_dict

    assert EngineConfig().async_scheduling is None
    for given, want in ((None, False), (True, True), (False, False)):
        eng = Engine(tiny_ckpt, engine_config=EngineConfig(num_pages=32, async_scheduling=given))
        try:
            assert eng.engine_config.async_scheduling is want and eng._runs_async() is want
            assert eng.core.config.async_scheduling is want  # the core schedules ahead only if the engine does
        finally:
            eng.shutdown()
    assert from_dict(EngineConfig, {"async_scheduling": None}).async_scheduling is None
    assert from_dict(EngineConfig, {"async_scheduling": True}).async_scheduling is True
