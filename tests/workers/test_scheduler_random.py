"""Randomized schedule-until-done: whatever the pool, budget, prompts and aborts, every page is accounted for at
every step (owned pages' reference counts match the page tables, no page both free and owned, no shared page
written), every finished sequence has the reference model's tokens, and the pool ends all free."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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


def check_invariants(s: Scheduler) -> None:
    pm = s.pages
    owners = pm.owners()
    refs = Counter(p for table in owners.values() for p in table)
    for page in range(pm.num_pages):
        assert pm.ref_count(page) == refs.get(page, 0), f"page {page}: ref count vs owners"
    for table in owners.values():
        assert len(set(table)) == len(table), "a page twice in one page table"
    free_ids = list(pm._free) + list(pm._evictable)
    assert len(set(free_ids)) == len(free_ids), "a page twice in the free lists"
    assert not set(free_ids) & set(refs), "a page both free and owned"
    assert len(free_ids) + len(refs) == pm.num_pages, "a page leaked"
    running_ids = {q.seq_id for q in s.running}
    assert set(owners) == running_ids, "only running sequences own pages"
    for q in s.running:
        assert q.status is SeqStatus.RUNNING
        assert len(owners[q.seq_id]) * pm.page_size >= q.num_computed_tokens
    for q in s.waiting:
        assert q.status is SeqStatus.WAITING and q.num_computed_tokens == 0
    assert len(s.running) <= s.config.max_num_seqs


request = st.tuples(
    st.lists(st.integers(0, 3), min_size=1, max_size=24),  # prompt over a tiny alphabet: prefixes repeat
    st.integers(1, 16),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(0, 8),  # arrival step
    st.one_of(st.none(), st.integers(0, 40)),  # abort step
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_pages=st.integers(6, 24),
    page_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 48),
    max_seqs=st.integers(3, 8),
    caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.1]),
    reqs=st.lists(request, min_size=1, max_size=12),
)
def test_schedule_until_done_keeps_every_page_accounted(num_pages, page_size, budget, max_seqs, caching, watermark, reqs):
    cfg = EngineConfig(max_model_len=128, max_num_seqs=max_seqs, max_num_batched_tokens=budget, num_pages=num_pages,
                       enable_prefix_caching=caching, admission_watermark=watermark)
    pm = PageManager(num_pages, page_size, enable_prefix_caching=caching, watermark=watermark)
    s = Scheduler(cfg, pm, eos_token_ids=(), vocab_size=97)
    sim = SimModel(s)
    accepted: dict[str, tuple[list[int], int, int | None]] = {}
    done = {}
    step = 0
    while step < 2000:
        for i, (prompt, max_tokens, n, arrive, abort) in enumerate(reqs):
            if arrive == step:
                try:
                    s.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n))
                    accepted[f"r{i}"] = (prompt, max_tokens, abort)
                except ValueError:
                    assert pm.pages_for(len(prompt) + max_tokens - 1) > num_pages or n > max_seqs
            if abort == step and f"r{i}" in s.requests:
                for q in s.abort(f"r{i}").seqs:
                    done[(f"r{i}", q.index)] = q
        if not s.has_unfinished() and step > 30:
            break
        _, res = sim.step()
        for q in res.finished:
            done[(q.request.request_id, q.index)] = q
        check_invariants(s)
        step += 1
    assert not s.has_unfinished(), "scheduling stalled"
    assert pm.num_free_pages == num_pages and not s.requests
    assert sim.written_shared == 0
    event(f"preempted: {s.num_preemptions > 0}")
    event(f"prefix hits: {pm.prefix_hits > 0}")
    for (rid, _i), q in done.items():
        prompt, max_tokens, _ = accepted[rid]
        if q.finish_reason == "length":
            assert q.output_token_ids == reference_output(prompt, max_tokens)
        else:
            assert q.finish_reason == "abort"
            assert q.output_token_ids == reference_output(prompt, max_tokens)[:q.num_output_tokens]
