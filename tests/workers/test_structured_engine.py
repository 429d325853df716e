"""Structured outputs through the engine (workers/core.py + batch + runner + sampler) on the tiny random model:
every sample of a constrained request follows its grammar (n > 1, mixed with unconstrained requests, under
preemption), the grammar's end finishes a sample with "stop" whatever ignore_eos / min_tokens say, a grammar that
does not compile is refused up front naming the field, and a disaggregated decode continues the grammar from the
first token the prefill engine sampled."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.workers.test_structured import SCHEMA
from workers.request import SamplingParams
from workers.structured import GrammarSpec, allocate_token_bitmask

# Room for the schema's longest output: bounded values, at most 16 whitespace characters a gap.
MAX_TOKENS = 600
SEEDS = range(6)


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _params(seed: int, structured: GrammarSpec | None, **kw) -> SamplingParams:
    return SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=structured, **kw)


def test_every_sample_follows_the_schema_beside_unconstrained_requests(make_llm):
    llm = make_llm(num_pages=256, max_model_len=1024)
    spec = GrammarSpec.json_schema(SCHEMA)
    # constrained and unconstrained requests share every step: only the constrained rows are masked
    params = [_params(s, spec) for s in SEEDS] + [_params(s, None, ignore_eos=True) for s in SEEDS[:2]]
    outs = llm.generate(["Answer in JSON:"] * len(params), params)
    constrained = [c for o in outs[:len(SEEDS)] for c in o.outputs]
    assert len(constrained) == 2 * len(SEEDS)
    for c in constrained:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        assert _valid(c.text), c.text
    docs = {json.dumps(json.loads(c.text), sort_keys=True) for c in constrained}
    assert len(docs) > len(SEEDS) // 2, "the logits still choose: different seeds give different documents"
    for o in outs[len(SEEDS):]:
        assert all(c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS for c in o.outputs)


def test_the_same_seeds_without_the_grammar_give_no_valid_document(make_llm):
    """What the test above would see without the mask: the random model writes no JSON."""
    llm = make_llm(num_pages=256, max_model_len=1024)
    outs = llm.generate(["Answer in JSON:"] * len(SEEDS), [_params(s, None) for s in SEEDS])
    assert not any(_valid(c.text) for o in outs for c in o.outputs)


def test_preempted_samples_resume_their_grammar_without_replaying_it(make_llm):
    """A pool too small for every sequence at once: samples are preempted and recomputed (their prompt and
    output run again, sampling nothing new), and still every one ends on a valid document."""
    llm = make_llm(num_pages=48, max_model_len=1024, max_num_batched_tokens=256)
    spec = GrammarSpec.json_schema(SCHEMA)
    outs = llm.generate(["Answer in JSON: " * 6] * 4, [_params(s, spec) for s in range(4)])
    assert llm.engine.scheduler.num_preemptions > 0, "the test needs preemption"
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop" and _valid(c.text), (c.finish_reason, c.text)


def test_the_grammar_end_finishes_the_sample(make_llm):
    """EOS ignored and min_tokens far away: the grammar is complete after a choice, so the sample ends there
    ("stop") rather than being held open with no allowed token."""
    llm = make_llm(num_pages=64)
    choices = ["yes", "no", "maybe later"]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, min_tokens=30, ignore_eos=True,
                            structured=GrammarSpec.choice(choices))
    (out,) = llm.generate(["Pick one:"], params)
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.text in choices, (c.finish_reason, c.text)
        assert len(c.token_ids) < 30
        assert c.token_ids[-1] in llm.engine.eos_token_ids


@pytest.mark.parametrize("spec, field", [(GrammarSpec.regex("((", source="guided_regex"), "guided_regex"),
                                         (GrammarSpec.json_schema({"type": "frob"}), "structured")])
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(make_llm, spec, field):
    llm = make_llm(num_pages=64)
    with pytest.raises(ValueError, match=rf"^{field}: "):
        llm.engine.validate_request([5, 6, 7], SamplingParams(structured=spec))
    with pytest.raises(ValueError, match=rf"^{field}: "):
        llm.generate(["x"], SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished()


def test_decode_engine_continues_the_grammar_from_the_prefill_token(make_llm):
    """Disaggregation in miniature, on one core's public seams: a request admitted as remote whose first token
    was sampled elsewhere under the grammar; the decode side advances its own grammar with that token first."""
    from workers.core import EngineCore

    llm = make_llm(num_pages=64)
    eng = llm.engine
    core = EngineCore(eng.engine_config, num_pages=64, page_size=eng.page_size, eos_token_ids=eng.eos_token_ids,
                      vocab_size=eng.model_config.vocab_size, role="decode", grammars=eng.grammars)
    tok = eng.tokenizer
    params = SamplingParams(max_tokens=20, structured=GrammarSpec.choice(["alpha", "beta"]))
    prompt = tok.encode("Pick:")
    first = tok.encode("alpha")[0]
    assert core.add_remote("r", prompt, params) is not None
    core.activate_remote("r", first, None)
    batch = core.schedule()
    assert batch.bitmask_rows == [0] and batch.token_bitmask.shape[0] == 1
    allowed = _allowed(batch.token_bitmask[0], eng.model_config.vocab_size)
    assert allowed and all("alpha".startswith(tok.decode([first, t])) for t in allowed), \
        [tok.decode([first, t]) for t in allowed]
    # without that first token the grammar would still allow starting "beta"
    fresh = eng.grammars.get().state(params.structured)
    bits = allocate_token_bitmask(1, eng.model_config.vocab_size)
    fresh.fill_bitmask(bits, 0)
    assert any(tok.decode([t]).startswith("b") for t in _allowed(bits[0].numpy(), eng.model_config.vocab_size))


def _allowed(row, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}


@pytest.mark.gpu
def test_schema_on_cuda(make_llm):
    """The same through a CUDA shard: the bitmask staged with the batch, xgrammar's triton kernel, decode graphs."""
    llm = make_llm(device="cuda", num_pages=256, max_model_len=1024)
    spec = GrammarSpec.json_schema(SCHEMA)
    outs = llm.generate(["Answer in JSON:"] * len(SEEDS), [_params(s, spec) for s in SEEDS])
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop" and _valid(c.text), (c.finish_reason, c.text)
