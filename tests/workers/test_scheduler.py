"""Scheduler: exact chunks and page ids for admission, chunked prefill, budgets, preemption, stops and aborts."""
from __future__ import annotations

import pytest

from workers.config import EngineConfig
from workers.pages import PageManager
from workers.request import SamplingParams
from workers.scheduler import Scheduler, SeqStatus


def _load_sim():
    """sched_sim.py beside this file (importlib import mode puts no test folder on sys.path)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("workers_tests_sched_sim", Path(__file__).with_name("sched_sim.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_sim = _load_sim()
SimModel, reference_output = _sim.SimModel, _sim.reference_output


def make(num_pages=32, page_size=4, *, budget=64, max_seqs=8, max_len=256, caching=True, watermark=0.0, eos=(96,)):
    cfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                       num_pages=num_pages, enable_prefix_caching=caching, admission_watermark=watermark)
    pm = PageManager(num_pages, page_size, enable_prefix_caching=caching, watermark=watermark)
    return Scheduler(cfg, pm, eos_token_ids=eos, vocab_size=97)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def chunks_of(out):
    return [(c.seq.request.request_id, c.start, c.num_tokens, c.is_decode, c.sample) for c in out.chunks]


def run_to_end(sim, max_steps=1000):
    done = {}
    for _ in range(max_steps):
        if not sim.sched.has_unfinished():
            return done
        _, res = sim.step()
        for s in res.finished:
            done[(s.request.request_id, s.index)] = s
    raise AssertionError("did not finish")


def test_admission_page_ids_and_decode_growth():
    s = make(num_pages=8, page_size=4)
    sim = SimModel(s)
    a = s.add_request("a", list(range(1, 6)), greedy(8, ignore_eos=True))
    b = s.add_request("b", [10, 11, 12], greedy(8, ignore_eos=True))
    out, res = sim.step()
    assert chunks_of(out) == [("a", 0, 5, False, True), ("b", 0, 3, False, True)]
    assert s.pages.page_table(a.seqs[0].seq_id) == [0, 1]
    assert s.pages.page_table(b.seqs[0].seq_id) == [2]
    assert [t for _, t in res.new_tokens] == [reference_output(list(range(1, 6)), 1)[0], reference_output([10, 11, 12], 1)[0]]
    out, _ = sim.step()  # decode: a writes position 5 (page 1), b writes position 3 (page 2)
    assert chunks_of(out) == [("a", 5, 1, True, True), ("b", 3, 1, True, True)]
    assert s.pages.page_table(b.seqs[0].seq_id) == [2]
    sim.step()  # b writes position 4: a new page
    assert s.pages.page_table(b.seqs[0].seq_id) == [2, 3]
    assert s.pages.num_free_pages == 4


def test_finish_on_max_tokens_frees_pages_and_matches_reference():
    s = make(num_pages=16, page_size=4)
    sim = SimModel(s)
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8], "c": list(range(20, 33))}
    for rid, p in prompts.items():
        s.add_request(rid, p, greedy(6, ignore_eos=True))
    done = run_to_end(sim)
    for rid, p in prompts.items():
        seq = done[(rid, 0)]
        assert seq.finish_reason == "length" and seq.output_token_ids == reference_output(p, 6)
    assert s.pages.num_free_pages == 16 and not s.requests and sim.written_shared == 0


def test_chunked_prefill_boundaries_and_decode_suffix():
    s = make(num_pages=32, page_size=4, budget=8)
    sim = SimModel(s)
    s.add_request("d", [5, 6], greedy(20, ignore_eos=True))
    sim.step()  # d prefilled, now decoding
    long = list(range(30, 50))  # 20 tokens
    s.add_request("p", long, greedy(3, ignore_eos=True))
    steps = [chunks_of(sim.step()[0]) for _ in range(4)]
    # d's decode row (1 token) always goes first in the running order but is ordered last in the batch;
    # p gets the remaining 7 tokens of the budget per step: 7 + 7 + 6 (the last chunk samples)
    assert steps[0] == [("p", 0, 7, False, False), ("d", 2, 1, True, True)]
    assert steps[1] == [("p", 7, 7, False, False), ("d", 3, 1, True, True)]
    assert steps[2] == [("p", 14, 6, False, True), ("d", 4, 1, True, True)]
    assert steps[3] == [("d", 5, 1, True, True), ("p", 20, 1, True, True)]
    done = run_to_end(sim)
    assert done[("p", 0)].output_token_ids == reference_output(long, 3)
    assert done[("d", 0)].output_token_ids == reference_output([5, 6], 20)


def test_token_budget_and_max_num_seqs_limit_each_step():
    s = make(num_pages=64, page_size=4, budget=10, max_seqs=3)
    sim = SimModel(s)
    for i in range(6):
        s.add_request(f"r{i}", [i + 1] * (4 + i), greedy(5, ignore_eos=True))
    max_running = 0
    for _ in range(100):
        if not s.has_unfinished():
            break
        out, _ = sim.step()
        assert out.num_tokens <= 10
        assert len(out.chunks) <= 3
        max_running = max(max_running, s.num_running)
    assert max_running == 3 and not s.has_unfinished()
    assert s.pages.num_free_pages == 64


def test_eos_min_tokens_stop_token_ids_and_ignore_eos():
    prompt = [3, 1, 4]
    ref = reference_output(prompt, 12)
    eos = ref[2]  # the model's third token plays EOS
    cases = {
        "eos": (greedy(12), 3, "stop", None),
        "min": (greedy(12, min_tokens=4), None, None, None),
        "ign": (greedy(12, ignore_eos=True), 12, "length", None),
        "ids": (greedy(12, ignore_eos=True, stop_token_ids=(ref[4],)), 5, "stop", ref[4]),
    }
    s = make(eos=(eos,))
    sim = SimModel(s)
    for rid, (p, *_r) in cases.items():
        s.add_request(rid, prompt, p)
    done = run_to_end(sim)
    for rid, (_p, n, reason, stop_reason) in cases.items():
        seq = done[(rid, 0)]
        if rid == "min":  # EOS at position 3 is ignored under min_tokens=4; stops at the next EOS, or length
            later = [i for i, t in enumerate(ref) if t == eos and i >= 3]
            n = later[0] + 1 if later else 12
            reason = "stop" if later else "length"
        assert seq.output_token_ids == ref[:n], rid
        assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason), rid


def test_abort_waiting_mid_prefill_and_mid_decode_frees_everything():
    s = make(num_pages=16, page_size=4, budget=6, max_seqs=2)
    sim = SimModel(s)
    s.add_request("dec", [1, 2, 3], greedy(50, ignore_eos=True))
    sim.step()
    s.add_request("pre", list(range(40, 60)), greedy(5))
    s.add_request("wait", [7, 7, 7], greedy(5))
    sim.step()
    pre = s.requests["pre"].seqs[0]
    assert pre.status is SeqStatus.RUNNING and 0 < pre.num_computed_tokens < 20
    assert s.requests["wait"].seqs[0].status is SeqStatus.WAITING
    for rid in ("pre", "wait", "dec"):
        req = s.abort(rid)
        assert all(q.finish_reason == "abort" for q in req.seqs)
    assert s.abort("dec") is None
    assert not s.has_unfinished() and s.pages.num_used_pages == 0


def test_preemption_newest_first_requeued_at_front_and_same_outputs():
    # 6 pages of 4 tokens; two requests that each grow to 3-4 pages cannot both stay resident.
    prompts = {"old": [1, 2, 3, 4, 5], "new": [9, 9, 9, 9, 9]}
    s = make(num_pages=6, page_size=4, caching=False)
    sim = SimModel(s)
    for rid, p in prompts.items():
        s.add_request(rid, p, greedy(12, ignore_eos=True))
    sim.step()
    old, new = s.requests["old"].seqs[0], s.requests["new"].seqs[0]
    assert s.pages.page_table(old.seq_id) == [0, 1] and s.pages.page_table(new.seq_id) == [2, 3]
    preempted_at = None
    for step in range(40):
        out, _ = sim.step()
        if out.preempted:
            assert out.preempted == [new]  # the newest goes, the older one keeps running
            assert s.waiting[0] is new and new.num_computed_tokens == 0 and not s.pages.has(new.seq_id)
            assert [c.seq for c in out.chunks] == [old]
            preempted_at = step
            break
    assert preempted_at is not None
    done = run_to_end(sim)
    assert done[("new", 0)].num_preemptions >= 1 and s.num_preemptions >= 1
    for rid, p in prompts.items():
        assert done[(rid, 0)].output_token_ids == reference_output(p, 12)
    assert s.pages.num_free_pages == 6


def test_a_lone_sequence_that_runs_out_preempts_itself_then_resumes():
    s = make(num_pages=3, page_size=4, caching=False)  # 12 slots
    sim = SimModel(s)
    s.add_request("a", [1] * 3, greedy(9, ignore_eos=True))  # needs 3 + 9 - 1 = 11 slots: fits
    s.add_request("b", [2] * 3, greedy(9, ignore_eos=True))
    done = run_to_end(sim)
    assert done[("a", 0)].output_token_ids == reference_output([1] * 3, 9)
    assert done[("b", 0)].output_token_ids == reference_output([2] * 3, 9)
    assert s.pages.num_free_pages == 3


def test_prefix_hit_skips_cached_pages():
    s = make(num_pages=16, page_size=4)
    sim = SimModel(s)
    shared = list(range(1, 11))  # 10 tokens: 2 full pages
    s.add_request("a", shared + [50], greedy(2, ignore_eos=True))
    a_pages = None
    out, _ = sim.step()
    a_pages = list(s.pages.page_table(s.requests["a"].seqs[0].seq_id))
    s.add_request("b", shared + [60, 61], greedy(2, ignore_eos=True))
    out, _ = sim.step()
    b = s.requests["b"].seqs[0]
    assert ("b", 8, 4, False, True) in chunks_of(out)
    assert s.pages.page_table(b.seq_id)[:2] == a_pages[:2]
    assert s.requests["b"].prefix_cache_hit_tokens == 8
    done = run_to_end(sim)
    assert done[("b", 0)].output_token_ids == reference_output(shared + [60, 61], 2)
    assert s.pages.num_free_pages == 16 and s.pages.num_cached_pages > 0


def test_n_samples_fork_sharing_full_prompt_pages():
    s = make(num_pages=16, page_size=4, caching=False)
    sim = SimModel(s)
    prompt = list(range(1, 11))  # 10 tokens: pages 0, 1 full, page 2 partial
    req = s.add_request("n", prompt, greedy(3, n=3, ignore_eos=True))
    assert [q.status for q in req.seqs] == [SeqStatus.WAITING, SeqStatus.PENDING_FORK, SeqStatus.PENDING_FORK]
    sim.step()
    p, c1, c2 = req.seqs
    assert c1.status is SeqStatus.RUNNING and c1.num_computed_tokens == 8
    assert s.pages.page_table(c1.seq_id) == [0, 1] == s.pages.page_table(p.seq_id)[:2]
    out, _ = sim.step()
    # the forks compute the tail page themselves (2 tokens each) into private pages
    assert ("n", 8, 2, False, True) in chunks_of(out)
    assert s.pages.page_table(c1.seq_id) == [0, 1, 3] and s.pages.page_table(c2.seq_id) == [0, 1, 4]
    assert s.pages.ref_count(0) == 3
    done = run_to_end(sim)
    for i in range(3):
        assert done[("n", i)].output_token_ids == reference_output(prompt, 3)
    assert sim.written_shared == 0 and s.pages.num_free_pages == 16


def test_abort_before_fork_finishes_pending_samples():
    s = make(budget=4)
    s.add_request("n", list(range(10)), greedy(3, n=2))
    sim = SimModel(s)
    sim.step()
    req = s.abort("n")
    assert [q.finish_reason for q in req.seqs] == ["abort", "abort"]
    assert s.pages.num_used_pages == 0


def test_validation_names_the_field():
    s = make(num_pages=4, page_size=4, max_len=32)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_request("e", [], greedy(1))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_request("v", [97], greedy(1))
    with pytest.raises(ValueError, match="stop_token_ids: token id 97"):  # would index the logits out of range
        s.add_request("s", [1], SamplingParams(max_tokens=1, stop_token_ids=(3, 97)))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_request("l", [1] * 32, greedy(1))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request("m", [1] * 30, greedy(3))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request("p", [1] * 10, greedy(8))  # 17 slots > 16 in the pool
    with pytest.raises(ValueError, match="n:"):
        s.add_request("n", [1], greedy(1, n=9))
    s.add_request("ok", [1] * 10, greedy(7))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request("ok", [1], greedy(1))
    assert s.requests["ok"].max_tokens == 7
    s.add_request("none", [1] * 4, SamplingParams(max_tokens=None))
    assert s.requests["none"].max_tokens == 13  # not max_len - prompt = 28: one sequence can hold 16 tokens
    s2 = make(num_pages=64, page_size=4, max_len=32)
    s2.add_request("none", [1] * 4, SamplingParams(max_tokens=None))
    assert s2.requests["none"].max_tokens == 28


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_held(wait, *, budget=64, max_seqs=8):
    clock = FakeClock()
    cfg = EngineConfig(max_model_len=256, max_num_seqs=max_seqs, max_num_batched_tokens=budget, num_pages=64,
                       admission_watermark=0.0, prefill_batch_wait_s=wait)
    s = Scheduler(cfg, PageManager(64, 4, watermark=0.0), eos_token_ids=(96,), vocab_size=97, clock=clock)
    return s, clock


def test_prompts_arriving_while_others_decode_wait_to_share_a_prefill_step():
    s, clock = make_held(0.5)  # binary fractions of a second: the sums below are exact
    sim = SimModel(s)
    s.add_request("a", [1, 2, 3], greedy(20, ignore_eos=True))
    out, _ = sim.step()  # nothing decodes: a is admitted at once
    assert chunks_of(out) == [("a", 0, 3, False, True)]
    s.add_request("b", [4, 5], greedy(4, ignore_eos=True))
    clock.now += 0.25
    out, _ = sim.step()  # a decodes; b has waited 0.25 s of 0.5: held
    assert chunks_of(out) == [("a", 3, 1, True, True)]
    s.add_request("c", [6, 7, 8], greedy(4, ignore_eos=True))
    clock.now += 0.125
    out, _ = sim.step()  # b 0.375 s: still held, c with it
    assert chunks_of(out) == [("a", 4, 1, True, True)]
    clock.now += 0.125
    out, _ = sim.step()  # b has waited 0.5 s: b and c share one prefill step
    assert chunks_of(out) == [("b", 0, 2, False, True), ("c", 0, 3, False, True), ("a", 5, 1, True, True)]
    assert s.requests["b"].first_scheduled_time - s.requests["b"].queued_at == 0.5


def test_the_hold_ends_early_when_waiting_prompts_fill_the_budget_or_the_seats():
    s, clock = make_held(1.0, budget=16, max_seqs=4)
    sim = SimModel(s)
    s.add_request("a", [1, 2, 3], greedy(20, ignore_eos=True))
    sim.step()
    s.add_request("b", [4, 5, 6, 7, 8, 9], greedy(4, ignore_eos=True))
    out, _ = sim.step()
    assert [c[0] for c in chunks_of(out)] == ["a"]  # held: 6 tokens of 15 left in the budget
    s.add_request("c", list(range(10, 19)), greedy(4, ignore_eos=True))
    out, _ = sim.step()  # b + c = 15 tokens >= the 15 the decode row leaves: no reason to wait
    assert [c[0] for c in chunks_of(out)] == ["b", "c", "a"]
    s2, _ = make_held(1.0, budget=64, max_seqs=3)
    sim2 = SimModel(s2)
    s2.add_request("a", [1, 2, 3], greedy(20, ignore_eos=True))
    sim2.step()
    s2.add_request("b", [4], greedy(4, ignore_eos=True))
    assert [c[0] for c in chunks_of(sim2.step()[0])] == ["a"]
    s2.add_request("c", [5], greedy(4, ignore_eos=True))
    assert [c[0] for c in chunks_of(sim2.step()[0])] == ["b", "c", "a"]  # b and c take the last two seats


def test_no_hold_without_decodes_for_preempted_sequences_or_when_off():
    s, clock = make_held(1.0)
    sim = SimModel(s)
    s.add_request("a", [1, 2, 3], greedy(4, ignore_eos=True))
    s.add_request("b", [4, 5], greedy(4, ignore_eos=True))
    out, _ = sim.step()  # nothing decodes yet: both admitted at once
    assert [c[0] for c in chunks_of(out)] == ["a", "b"]
    victim = s.running[-1]
    s._preempt(victim)  # back to the waiting queue's head, with its output token
    out, _ = sim.step()
    assert [c[0] for c in chunks_of(out)] == ["b", "a"]  # resumes at once (prefill of its tokens), a decodes
    off, _ = make_held(0.0)
    sim_off = SimModel(off)
    off.add_request("a", [1, 2, 3], greedy(20, ignore_eos=True))
    sim_off.step()
    off.add_request("b", [4, 5], greedy(4, ignore_eos=True))
    assert [c[0] for c in chunks_of(sim_off.step()[0])] == ["b", "a"]


def test_prefill_batch_wait_is_validated_and_off_by_default():
    with pytest.raises(ValueError, match="prefill_batch_wait_s"):
        EngineConfig(prefill_batch_wait_s=-1.0)
    assert EngineConfig().prefill_batch_wait_s == 0.0
