"""Engine behaviour on the tiny checkpoint: seeded sampling, stop strings and stop ids, aborts in every state,
KV pool sizing, request validation. Every engine must end with all pages free (the make_llm fixture checks)."""
from __future__ import annotations

import random

import pytest

from msa.config import load_config
from msa.kv_cache import KVCache
from workers.request import SamplingParams
from workers.text import RequestText

REPLACEMENT = "\ufffd"


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 384) for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_seeded_sampling_reproduces_whatever_the_batch(make_llm):
    llm = make_llm(num_pages=64)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=8, ignore_eos=True)
    n2 = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=8, ignore_eos=True)
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=8, ignore_eos=True)  # only the argmax survives
    p20, p30 = {"prompt_token_ids": ids(20)}, {"prompt_token_ids": ids(30, 1)}
    first = llm.generate([p20, p20, p30, p30, p30], [seeded, other_seed, n2, top1, greedy(8)])
    # again, in a different batch (other requests, other order): seeded rows draw from their own generators
    noise = SamplingParams(temperature=1.0, max_tokens=4)
    again = llm.generate([{"prompt_token_ids": ids(9, 2)}, p30, p20], [noise, n2, seeded])
    toks = [[c.token_ids for c in o.outputs] for o in first]
    assert again[2].outputs[0].token_ids == toks[0][0]
    assert toks[1][0] != toks[0][0]
    assert [c.token_ids for c in again[1].outputs] == toks[2] and toks[2][0] != toks[2][1]
    assert toks[3] == toks[4]


def _clean_substring(text: str) -> tuple[int, str]:
    """A 2-character stop string from the middle of `text` (no replacement characters, first occurrence)."""
    for a in range(2, len(text) - 2):
        s = text[a:a + 2]
        if REPLACEMENT not in s and text.find(s) == a and not s.isspace():
            return a, s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_output_and_are_excluded(make_llm):
    llm = make_llm(num_pages=64)
    prompt = {"prompt_token_ids": ids(25, 3)}
    full = llm.generate(prompt, greedy(24))[0].outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    a, stop = _clean_substring(full.text)

    out = llm.generate(prompt, greedy(24, stop=(stop,)))[0].outputs[0]
    assert out.text == full.text[:a]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert stop in llm.tokenizer.decode(out.token_ids)  # the token completing the stop string is kept
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])

    kept = llm.generate(prompt, greedy(24, stop=(stop,), include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:a + len(stop)] and kept.token_ids == out.token_ids


def test_streamed_text_never_shows_a_partial_stop_string(make_llm):
    llm = make_llm(num_pages=64)
    eng = llm.engine
    prompt = ids(25, 3)
    full = llm.generate({"prompt_token_ids": prompt}, greedy(24))[0].outputs[0]
    a, stop = _clean_substring(full.text)
    params = greedy(24, stop=(stop,))
    eng.add_request("s", prompt, params)
    text = RequestText(llm.tokenizer, prompt, params)  # as the ingress makes it from the engine's token ids
    texts, seen, shown = [], 0, ""
    while eng.has_unfinished():
        for o in eng.step():
            assert o.outputs[0].text == ""  # the engine sends token ids only
            comp = o.outputs[0]
            delta = text.add(0, comp.token_ids[seen:], None, comp.finish_reason, comp.stop_reason)
            seen = len(comp.token_ids)
            shown += delta.text
            texts.append(shown)
            if delta.stop_hit:
                assert eng.stop_sample("s", 0, stop)[0].finished  # the engine stops it before its next step
    for t in texts:  # every partial text is a prefix of the final one: the stream only grows
        assert texts[-1].startswith(t)
    assert texts[-1] == full.text[:a]
    assert text.samples[0].finish_reason == "stop" and len(texts) < 24
    assert {s.request_id: s.finished_reason for s in eng.pop_request_stats()}["s"] == "stop"


def test_a_stop_string_ends_one_sample_the_others_go_on(make_llm):
    """n=2, seeded: a stop string found in sample 0's text stops sample 0 in the engine (`stop_sample`); sample 1
    runs on to its length with the very tokens it draws without the stop string."""
    llm = make_llm(num_pages=64)
    prompt = {"prompt_token_ids": ids(20, 7)}
    base = dict(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    free = llm.generate(prompt, SamplingParams(**base))[0].outputs
    a, stop = next((a, free[0].text[a:a + 2]) for a in range(2, len(free[0].text) - 2)
                   if REPLACEMENT not in free[0].text[a:a + 2] and free[0].text.find(free[0].text[a:a + 2]) == a
                   and free[0].text[a:a + 2] not in free[1].text and free[0].text[a:a + 2].strip())
    out = llm.generate(prompt, SamplingParams(**base, stop=(stop,)))[0].outputs
    assert (out[0].text, out[0].finish_reason, out[0].stop_reason) == (free[0].text[:a], "stop", stop)
    assert out[0].token_ids == free[0].token_ids[:len(out[0].token_ids)] and len(out[0].token_ids) < 24
    assert (out[1].token_ids, out[1].text, out[1].finish_reason) == (free[1].token_ids, free[1].text, "length")
    assert [s.finished_reason for s in llm.engine.pop_request_stats()][-1] == "stop"


def test_stop_token_ids_and_min_tokens(make_llm):
    llm = make_llm(num_pages=64)
    prompt = {"prompt_token_ids": ids(30, 5)}
    full = llm.generate(prompt, greedy(12))[0].outputs[0].token_ids
    target = full[3]
    first = full.index(target)
    out = llm.generate(prompt, greedy(12, stop_token_ids=(target,)))[0].outputs[0]
    assert out.token_ids == full[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)
    # under min_tokens the stop id may not be sampled before 5 tokens exist
    late = llm.generate(prompt, greedy(12, stop_token_ids=(target,), min_tokens=5))[0].outputs[0]
    assert late.token_ids[:first] == full[:first] and target not in late.token_ids[:5]


def test_eos_stops_unless_ignored(make_llm):
    llm = make_llm(num_pages=256, max_num_seqs=24)
    eng = llm.engine
    assert eng.eos_token_ids == (2,) and eng.scheduler.eos_token_ids == {2}  # tokenizer and config agree
    # one batched greedy run over many prompts: some continuation meets EOS (fixed seeds: deterministic)
    prompts = [{"prompt_token_ids": ids(6, 1000 + s)} for s in range(24)]
    runs = llm.generate(prompts, greedy(24))
    hit = next((i for i, r in enumerate(runs) if 2 in r.outputs[0].token_ids), None)
    assert hit is not None, "no EOS in 24 x 24 greedy tokens: pick other seeds"
    full = runs[hit].outputs[0].token_ids
    out = llm.generate(prompts[hit], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == full[:full.index(2) + 1] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == llm.tokenizer.decode(out.token_ids)  # EOS is a special token: not in the text


def test_aborts_in_every_state_free_pages(make_llm):
    llm = make_llm(num_pages=40, max_num_batched_tokens=32, max_num_seqs=2)
    eng = llm.engine
    eng.add_request("decoding", ids(10), greedy(50))
    eng.step()
    eng.step()
    eng.add_request("prefilling", ids(200, 1), greedy(5))
    eng.add_request("waiting", ids(10, 2), greedy(5))
    eng.step()
    reqs = eng.scheduler.requests
    assert reqs["decoding"].seqs[0].num_output_tokens >= 2
    assert 0 < reqs["prefilling"].seqs[0].num_computed_tokens < 200
    assert reqs["waiting"].seqs[0].num_computed_tokens == 0 and eng.scheduler.num_waiting == 1
    assert eng.stats().num_pages_free < 40
    for rid in ("prefilling", "decoding", "waiting"):
        assert eng.abort_request(rid)
    assert not eng.abort_request("decoding")
    assert eng.stats().num_pages_free == 40 and not eng.has_unfinished()
    reasons = {s.request_id: s.finished_reason for s in eng.pop_request_stats()}
    assert reasons == {"prefilling": "abort", "decoding": "abort", "waiting": "abort"}


def test_kv_pool_sized_from_byte_budget(make_llm, tiny_ckpt):
    per_page = KVCache.bytes_per_page(load_config(tiny_ckpt))
    llm = make_llm(kv_cache_bytes=per_page * 37 + per_page // 2, max_model_len=512)  # 37 pages hold 592 tokens
    assert llm.engine.num_pages == 37 and llm.engine.stats().num_pages_total == 37
    assert llm.engine.executor.info()["kv_bytes"] == 37 * per_page


def test_bad_requests_name_the_field(make_llm):
    llm = make_llm(num_pages=16, max_model_len=128)
    eng = llm.engine
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("a", [], greedy(1))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("b", [384], greedy(1))
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("c", ids(100), greedy(29))
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([{"prompt_token_ids": [5]}, {"text": "x"}], greedy(1))
    assert not eng.has_unfinished()


def test_string_prompts_and_request_stats(make_llm):
    llm = make_llm(num_pages=64)
    out = llm.generate(["hello world", "a much longer prompt about pages"], greedy(4))
    assert [o.prompt for o in out] == ["hello world", "a much longer prompt about pages"]
    assert out[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    st = llm.engine.pop_request_stats()
    assert len(st) == 2
    for s in st:
        assert s.generation_tokens == 4 and len(s.token_times) == 4 and s.ttft >= 0 and s.e2e_latency >= s.ttft
        assert s.finished_reason == "length"
    steps = llm.engine.pop_step_stats()
    assert steps and all(0 <= s.host_overhead <= s.step_time for s in steps)


def test_public_imports_are_vllm_shaped():
    import workers
    import workers.llm
    from workers import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: F401

    assert LLM is workers.llm.LLM and set(workers.__all__) >= {"LLM", "SamplingParams", "RequestOutput"}
