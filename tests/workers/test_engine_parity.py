"""Through the `LLM` API, many concurrent requests give exactly what `transformers` greedy generation gives for
each prompt alone (tokens equal, top-5 logprobs within 1e-4), with chunked prefill, prefix sharing, n > 1 and
preemption in play. Prompts up to 200 tokens: the tiny model's sparse layers select 4 of up to 13 blocks."""
from __future__ import annotations

import random

import pytest
import torch

from workers.request import SamplingParams

LENGTHS = [3, 7, 16, 17, 31, 48, 64, 65, 80, 97, 110, 128, 129, 150, 170, 200]
MAX_TOKENS = [1, 12, 5, 9, 12, 3, 10, 12, 7, 12, 4, 11, 12, 6, 12, 8]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(hf_model):
    """Per prompt alone: transformers greedy tokens and the log_softmax of its raw logits at each step."""
    out = []
    for ids, k in zip(prompts(), MAX_TOKENS):
        with torch.no_grad():
            g = hf_model.generate(torch.tensor([ids]), max_new_tokens=k, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
        toks = g.sequences[0, len(ids):].tolist()
        lps = [torch.log_softmax(l[0].float(), -1) for l in g.logits]
        out.append((toks, lps))
    return out


def check(outputs, reference, *, logprobs=True):
    for r, (o, (toks, lps)) in enumerate(zip(outputs, reference)):
        c = o.outputs[0]
        assert c.token_ids == toks, f"prompt {r} (len {LENGTHS[r]})"
        assert c.finish_reason in ("length", "stop")
        if not logprobs:
            continue
        assert len(c.logprobs) == len(toks)
        for pos, (got, want) in enumerate(zip(c.logprobs, lps)):
            top = torch.topk(want, 5)
            assert set(got) >= set(top.indices.tolist()), f"prompt {r} pos {pos}: top-5 ids differ"
            for tid, lp in got.items():
                assert abs(lp - float(want[tid])) <= 1e-4, f"prompt {r} pos {pos} token {tid}"


def test_sixteen_concurrent_requests_match_transformers(make_llm, reference):
    # a small token budget: long prompts are chunked over several steps, mixed with other requests' decodes
    llm = make_llm(num_pages=256, max_num_batched_tokens=96, max_num_seqs=16)
    params = [SamplingParams(temperature=0.0, max_tokens=k, logprobs=5) for k in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    check(outputs, reference)
    steps = llm.engine.pop_step_stats()
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no step mixed prefill and decode"
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 96


def test_tiny_pool_preempts_and_still_matches(make_llm, reference):
    # 20 pages of 16 tokens: the 200-token prompt alone needs 13; the batch cannot all stay resident
    llm = make_llm(num_pages=20, max_num_batched_tokens=128, max_num_seqs=16, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    assert llm.engine.stats().num_preemptions > 0
    check(outputs, reference, logprobs=False)


def test_n_samples_share_prompt_pages_and_prefix_hits_match(make_llm, reference):
    llm = make_llm(num_pages=256)
    ps = prompts()
    # greedy n=3: every sample equals the single greedy output, though samples 1, 2 reuse sample 0's full pages
    i = LENGTHS.index(110)
    out = llm.generate({"prompt_token_ids": ps[i]}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], n=3))[0]
    assert [c.token_ids for c in out.outputs] == [reference[i][0]] * 3
    # the same prompts again: full pages come from the prefix cache
    before = llm.engine.stats().prefix_cache_hits
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps[8:]],
                           [SamplingParams(temperature=0.0, max_tokens=k) for k in MAX_TOKENS[8:]])
    assert llm.engine.stats().prefix_cache_hits > before
    check(outputs, reference[8:], logprobs=False)
    hits = {s.prompt_tokens: s.prefix_cache_hit_tokens for s in llm.engine.pop_request_stats()}
    assert hits[110] == 96  # 6 full pages of 16 (the 7th is partial)
    assert hits[170] == 0


def test_prompt_logprobs_match_transformers(make_llm, hf_model):
    # a 32-token budget splits the prompts into chunks; the same prompts ran before, so the prefix cache holds
    # their pages, which prompt-logprob requests must not use
    llm = make_llm(num_pages=64, max_num_batched_tokens=32)
    ps = [prompts()[i] for i in (3, 8, 13)]  # 17, 80 and 150 tokens
    llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0.0, max_tokens=1))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2))
    for p, o in zip(ps, outs):
        with torch.no_grad():
            want = torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
        plp = o.prompt_logprobs
        assert plp is not None and len(plp) == len(p) and plp[0] is None
        for i in range(1, len(p)):
            top = torch.topk(want[i - 1], 3).indices.tolist()
            assert set(plp[i]) == {p[i], *top}, f"len {len(p)} position {i}"
            for tid, lp in plp[i].items():
                assert abs(lp - float(want[i - 1, tid])) <= 1e-4


def test_seeded_sampling_survives_preemption(make_llm):
    """A preempted request is recomputed but keeps its sample's generator (seq ids are released only when the
    request ends), so seeded sampled outputs equal a run that never preempts."""
    params = [SamplingParams(temperature=0.8, max_tokens=k, seed=100 + i) for i, k in enumerate(MAX_TOKENS)]
    batch = [{"prompt_token_ids": p} for p in prompts()]
    roomy = make_llm(num_pages=256, max_num_batched_tokens=128, max_num_seqs=16)
    want = [o.outputs[0].token_ids for o in roomy.generate(batch, params)]
    tight = make_llm(num_pages=20, max_num_batched_tokens=128, max_num_seqs=16, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(batch, params)]
    assert tight.engine.stats().num_preemptions > 0
    assert got == want


def test_triton_prefill_path_matches_the_reference_path(make_llm, reference, monkeypatch):
    """The Triton kernels forced (`attention_backend="triton"`, through the interpreter here) give the reference
    path's greedy tokens and logprobs: prompts of several chunks (a 64-token budget) while others decode, chunk
    starts inside a block, sparse layers selecting 4 of up to 10 blocks; also with the indexer writing the chosen
    pages for the decode attention (msa/indexer.py WRITE_PAGES, off by default)."""
    from msa import indexer

    picks = [LENGTHS.index(n) for n in (17, 65, 150, 48)]
    batch = [{"prompt_token_ids": prompts()[i]} for i in picks]
    params = [SamplingParams(temperature=0.0, max_tokens=min(MAX_TOKENS[i], 4), logprobs=3) for i in picks]
    got = {}
    for name, backend, pages in (("ref", "ref", False), ("triton", "triton", False), ("pages", "triton", True)):
        monkeypatch.setattr(indexer, "WRITE_PAGES", pages)
        llm = make_llm(num_pages=128, max_num_batched_tokens=64, max_num_seqs=8, attention_backend=backend)
        got[name] = llm.generate(batch, params)
        steps = llm.engine.pop_step_stats()
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no step mixed prefill and decode"
        assert any(s.num_prefill_tokens == 64 for s in steps), "no prompt was split over chunks"
    pairs = [(a, b) for run in ("triton", "pages") for a, b in zip(got["ref"], got[run])]
    for j, (a, b) in enumerate(pairs):
        j %= len(picks)
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids, f"prompt {j}"
        assert cb.token_ids == reference[picks[j]][0][:len(cb.token_ids)]
        for pos, (la, lb) in enumerate(zip(ca.logprobs, cb.logprobs)):
            assert set(la) == set(lb), f"prompt {j} pos {pos}"
            assert max(abs(la[t] - lb[t]) for t in la) <= 1e-4, f"prompt {j} pos {pos}"
