"""The engine's startup warm-up (workers/warmup.py): it drives prompts of many lengths while others decode, then
leaves the engine exactly as a fresh one: nothing in flight, every page free, no cached prefix, counters at zero,
and the same tokens for the next request."""
from __future__ import annotations

import random

from workers.request import SamplingParams
from workers.warmup import LONGEST, MAX_TOKENS, warmup_arrivals, warmup_lengths


def test_lengths_cover_every_power_of_two_table_and_a_short_chunk_after_a_long_context():
    lengths = warmup_lengths(max_model_len=20000, chunk=8192, page_size=128)
    assert lengths[:3] == [1, 5, 17]
    assert [n for n in lengths if n % 128 == 125] == [128 * 2 ** k - 3 for k in range(1, 8)]  # 2 .. 128 pages
    assert 8192 + 700 in lengths and max(lengths) <= min(20000 - MAX_TOKENS, LONGEST)
    assert {700, 1500, 3000} <= set(lengths)  # short chunks while the widest table still decodes
    arrivals = warmup_arrivals(max_model_len=20000, chunk=8192, page_size=128, max_num_seqs=16)
    assert [len(a) for a in arrivals if len(a) > 1] == [3, 6, 12]  # bursts: no more than max_num_seqs at once
    assert all(n <= 300 - MAX_TOKENS for n in warmup_lengths(max_model_len=300, chunk=64, page_size=16))


def test_warm_up_leaves_the_engine_as_it_found_it(make_llm):
    prompt = [random.Random(5).randrange(3, 384) for _ in range(70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    cold = make_llm(max_model_len=300, max_num_batched_tokens=64, max_num_seqs=8)
    warm = make_llm(max_model_len=300, max_num_batched_tokens=64, max_num_seqs=8, warmup=True)
    assert cold.engine.warmup_report is None  # off on the CPU by default
    report = warm.engine.warmup_report
    assert report.requests == len(warmup_lengths(300, 64, warm.engine.page_size, 8)) and report.mixed_steps > 0
    eng = warm.engine
    st = eng.stats()
    assert not eng.has_unfinished() and st.num_pages_free == st.num_pages_total and st.num_pages_cached == 0
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.num_preemptions) == (0, 0, 0)
    assert eng.pop_request_stats() == [] and eng.pop_step_stats() == []
    a, b = cold.generate([{"prompt_token_ids": prompt}], params), warm.generate([{"prompt_token_ids": prompt}], params)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].logprobs == b[0].outputs[0].logprobs
