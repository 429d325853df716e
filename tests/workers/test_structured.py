"""Structured outputs (workers/structured.py + the sampler's bitmask stage) with the tiny model's real tokenizer
and random logits: the grammar forces valid JSON over many seeds (and without the mask the same sampling does
not), choice / regex / EBNF, batches where only some rows are constrained, a logits vocab wider than the
tokenizer's, EOS only at completion, rollback, the CPU kernels against a torch reference; CUDA under `gpu`."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from msa.checkpoint import special_token_ids, write_tokenizer
from msa.metadata import Stager
from tests.workers.conftest import tiny_config
from workers.request import SamplingParams
from workers.sampler import Sampler, SamplingBatch, make_generator
from workers.structured import (
    GrammarError,
    GrammarSpec,
    StructuredOutputCompiler,
    allocate_token_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    fill_token_bitmask,
    warm_up,
)
from workers.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["alpha", "beta", "gamma delta"]},
        "count": {"type": "integer", "minimum": -5, "maximum": 120},
        "ok": {"type": "boolean"},
        "inner": {
            "type": "object",
            "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}, "tag": {"enum": ["x", "y"]}},
            "required": ["level", "tag"],
            "additionalProperties": False,
        },
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99}, "maxItems": 2},
    },
    "required": ["name", "count", "ok", "inner", "flags"],
    "additionalProperties": False,
}
TOKEN_CAP = 700  # far above what the schema allows (bounded values, <= 16 whitespace characters a gap)
ROWS = 32  # one batch: half greedy, half sampled, each row its own seed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("structured-tok")
    write_tokenizer(tiny_config(), out)
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, tiny_config().vocab_size)


def _params(rows: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0 if r % 2 == 0 else 1.0) for r in range(rows)]


def _generate(compiler, spec, *, seed: int, rows: int = ROWS, masked: bool = True, vocab: int | None = None,
              logit_hook=None) -> tuple[list[list[int]], list[bool]]:
    """Sample `rows` sequences at once from seeded random logits through the engine's Sampler: fill bitmask ->
    sample -> accept, until every row's matcher terminated (or, unmasked, sampled EOS) or TOKEN_CAP steps.
    Returns (output ids without EOS, terminated) per row."""
    vocab = vocab or compiler.vocab_size
    states = [compiler.state(spec) for _ in range(rows)]
    logit_gen = torch.Generator().manual_seed(seed)
    gens = [make_generator(seed * 1000 + r) for r in range(rows)]
    eos = set(compiler.stop_token_ids)
    outs: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    params = _params(rows)
    for _ in range(TOKEN_CAP):
        live = [r for r in range(rows) if not done[r]]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=logit_gen) * 3.0
        if logit_hook is not None:
            logit_hook(logits)
        bitmask = fill_token_bitmask([states[r] for r in live], compiler.vocab_size) if masked else None
        batch = SamplingBatch.build([params[r] for r in live], [[0]] * len(live), [outs[r] for r in live],
                                    [gens[r] for r in live], "cpu", token_bitmask=bitmask)
        for r, t in zip(live, Sampler()(logits, batch).token_ids.tolist()):
            if masked:
                assert states[r].accept(t), f"row {r}: the sampler chose {t}, which the grammar forbids"
            if t in eos:
                done[r] = True
            else:
                outs[r].append(t)
    return outs, done


def _texts(tokenizer, outs):
    return [tokenizer.decode(o) for o in outs]


@pytest.mark.parametrize("seed", range(6))
def test_schema_forced_output_always_parses_and_validates(compiler, tokenizer, seed):
    outs, done = _generate(compiler, GrammarSpec.json_schema(SCHEMA), seed=seed)
    assert all(done), "every row must reach EOS: the grammar bounds the output"
    docs = [json.loads(t) for t in _texts(tokenizer, outs)]
    for d in docs:
        jsonschema.validate(d, SCHEMA)
    # Forced by the mask, yet still driven by the logits: the rows differ in content.
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > ROWS // 2
    assert {d["ok"] for d in docs} == {True, False}
    assert len({d["name"] for d in docs}) > 1 and len({d["count"] for d in docs}) > 1


def test_same_sampling_without_the_mask_gives_no_valid_json(compiler, tokenizer):
    outs, _ = _generate(compiler, GrammarSpec.json_schema(SCHEMA), seed=0, masked=False)
    valid = 0
    for text in _texts(tokenizer, outs):
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid == 0


def test_json_object_is_an_object(compiler, tokenizer):
    outs, done = _generate(compiler, GrammarSpec.json_object(), seed=3, rows=16)
    # Free-form JSON may run past the cap on random logits; every finished row must be an object.
    finished = [t for t, d in zip(_texts(tokenizer, outs), done) if d]
    assert finished, "no row finished"
    assert all(isinstance(json.loads(t), dict) for t in finished)


def test_choice_regex_and_ebnf(compiler, tokenizer):
    choices = ['say "hi"', "naïve\nline", "zz"]
    outs, done = _generate(compiler, GrammarSpec.choice(choices), seed=1)
    texts = _texts(tokenizer, outs)
    assert all(done) and set(texts) <= set(choices) and len(set(texts)) > 1
    outs, done = _generate(compiler, GrammarSpec.regex(r"[a-c]{2}-[0-9]{1,3}"), seed=2)
    assert all(done) and all(re.fullmatch(r"[a-c]{2}-[0-9]{1,3}", t) for t in _texts(tokenizer, outs))
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= "yes" | "no"'
    outs, done = _generate(compiler, GrammarSpec.grammar(ebnf), seed=4, rows=8)
    finished = [t for t, d in zip(_texts(tokenizer, outs), done) if d]
    assert finished and all(re.fullmatch(r"\((yes|no)(,(yes|no))*\)", t) for t in finished)


def test_eos_only_when_complete_then_only_eos(compiler, tokenizer):
    eos = compiler.stop_token_ids[0]
    state = compiler.state(GrammarSpec.regex("ab"))

    def allowed() -> set[int]:
        bm = allocate_token_bitmask(1, compiler.vocab_size)
        state.fill_bitmask(bm, 0)
        return _allowed_ids(bm[0], compiler.vocab_size)

    start = allowed()
    assert eos not in start and start
    a, b = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("b", add_special_tokens=False)
    assert not state.accept(eos) and state.num_accepted == 0  # refused: state unchanged
    assert state.accept_tokens(a + b) and state.is_completed() and not state.is_terminated()
    assert eos in allowed()
    assert state.accept(eos) and state.is_terminated()
    assert allowed() == set(compiler.stop_token_ids)
    state.rollback(len(a + b) + 1)
    assert not state.is_terminated() and allowed() == start
    with pytest.raises(ValueError):
        state.rollback(1)


def _allowed_ids(row: torch.Tensor, vocab: int) -> set[int]:
    return {i for i in range(vocab) if (int(row[i // 32]) >> (i % 32)) & 1}


def test_special_tokens_never_allowed(compiler, tokenizer):
    special = special_token_ids(tiny_config())
    state = compiler.state(GrammarSpec.json_object())
    assert state.accept_tokens(tokenizer.encode('{"', add_special_tokens=False))
    bm = allocate_token_bitmask(1, compiler.vocab_size)
    state.fill_bitmask(bm, 0)
    ok = _allowed_ids(bm[0], compiler.vocab_size)
    assert len(ok) > 100  # inside a string most text tokens are fine
    assert not ok & ({special.pad_id, special.bos_id, special.eos_id} | set(special.role_ids.values()))


def test_only_constrained_rows_are_masked(compiler):
    states = [compiler.state(GrammarSpec.json_object()), None, compiler.state(GrammarSpec.regex("[0-9]+")), None]
    bitmask = fill_token_bitmask(states, compiler.vocab_size)
    assert fill_token_bitmask([None, None], compiler.vocab_size) is None
    assert (bitmask[[1, 3]] == -1).all() and (bitmask[[0, 2]] != -1).any(dim=1).all()
    raw = torch.randn(4, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    logits = raw.clone()
    apply_token_bitmask(logits, bitmask)
    assert torch.equal(logits[[1, 3]], raw[[1, 3]])
    for r in (0, 2):
        ok = torch.zeros(compiler.vocab_size, dtype=torch.bool)
        ok[sorted(_allowed_ids(bitmask[r], compiler.vocab_size))] = True
        assert torch.equal(logits[r][ok], raw[r][ok]) and torch.isneginf(logits[r][~ok]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_torch_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    vocab = 300
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, 10), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[2] = -1
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    apply_token_bitmask_torch(ref, bitmask)
    assert torch.equal(ours, ref)
    expect = torch.tensor([[(int(bitmask[r, i // 32]) >> (i % 32)) & 1 for i in range(vocab)] for r in range(6)])
    assert torch.equal(torch.isneginf(ref), expect == 0)


def test_kernel_missing_or_strided_logits_fall_back_to_torch(monkeypatch):
    import xgrammar

    gen = torch.Generator().manual_seed(6)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 8), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, 256, generator=gen)
    ref = logits.clone()
    apply_token_bitmask_torch(ref, bitmask)
    strided = torch.randn(256, 4).t()  # [4, 256], not contiguous
    strided.copy_(logits)
    apply_token_bitmask(strided, bitmask)
    assert torch.equal(strided, ref)

    def no_triton(*args, **kwargs):
        raise ImportError("Triton is not installed")

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", no_triton)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask)
    assert torch.equal(ours, ref)
    warm_up("cpu", 100)  # runs through the same path


def test_logits_wider_than_the_tokenizer(tokenizer):
    tok_vocab = tokenizer.vocab_size
    wide = StructuredOutputCompiler(tokenizer, tok_vocab + 50)  # a padded lm_head
    assert wide.vocab_size == tok_vocab + 50 and wide.bitmask_width == -(-(tok_vocab + 50) // 32)

    def favour_padding(logits):  # the padded ids would win every argmax if they were allowed
        logits[:, tok_vocab:] = 100.0

    outs, done = _generate(wide, GrammarSpec.json_schema(SCHEMA), seed=9, rows=8, logit_hook=favour_padding)
    assert all(done) and all(t < tok_vocab for o in outs for t in o)
    for text in _texts(tokenizer, outs):
        jsonschema.validate(json.loads(text), SCHEMA)
    # Logits wider still than the mask: the ids past it are disallowed on constrained rows only.
    bitmask = fill_token_bitmask([wide.state(GrammarSpec.json_object()), None], wide.vocab_size)
    logits = torch.zeros(2, wide.bitmask_width * 32 + 40)
    apply_token_bitmask(logits, bitmask)
    assert torch.isneginf(logits[0, tok_vocab:]).all() and not torch.isneginf(logits[1]).any()


def test_logprobs_are_raw_and_input_untouched(compiler):
    states = [compiler.state(GrammarSpec.regex("[0-9]")), None]
    bitmask = fill_token_bitmask(states, compiler.vocab_size)
    logits = torch.randn(2, compiler.vocab_size, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(temperature=1.0, logprobs=2), SamplingParams(temperature=0.0, logprobs=2)]
    batch = SamplingBatch.build(params, [[0], [0]], [[], []], [make_generator(1), None], "cpu",
                                token_bitmask=bitmask, stage=Stager("cpu").stage)
    out = Sampler()(logits, batch)
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before, dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert states[0].accept(int(out.token_ids[0]))  # a digit, whatever the logits preferred


def test_compile_cache_and_errors(compiler):
    spec = GrammarSpec.json_schema(json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(SCHEMA))
    for bad in (lambda: compiler.compile(GrammarSpec.regex("((")),
                lambda: compiler.compile(GrammarSpec.json_schema({"type": "frob"})),
                lambda: compiler.compile(GrammarSpec.grammar("root ::= ")),
                lambda: compiler.compile(GrammarSpec.structural_tag({"type": "structural_tag",
                                                                     "format": {"type": "?"}})),
                lambda: GrammarSpec.choice([]), lambda: GrammarSpec.json_schema("{not json"),
                lambda: GrammarSpec("xml")):
        with pytest.raises(GrammarError):
            bad()


@pytest.mark.gpu
def test_cuda_apply_and_staged_sampling(compiler, tokenizer):
    dev = torch.device("cuda")
    warm_up(dev, compiler.vocab_size)
    gen = torch.Generator().manual_seed(11)
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, compiler.bitmask_width), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[3] = -1
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(8, compiler.vocab_size + 40, generator=gen).to(dtype)
        ref = logits.clone()
        apply_token_bitmask_torch(ref[:, :compiler.vocab_size], bitmask)
        ref[[r for r in range(8) if r != 3], compiler.vocab_size:] = float("-inf")
        ours = logits.to(dev)
        apply_token_bitmask(ours, bitmask)  # host bitmask: one copy inside
        assert torch.equal(ours.cpu(), ref)
    # The sampler with the bitmask staged in the runner's single pinned copy.
    stager = Stager(dev)
    states = [compiler.state(GrammarSpec.json_schema(SCHEMA)) for _ in range(4)]
    outs: list[list[int]] = [[] for _ in states]
    for _ in range(TOKEN_CAP):
        if all(s.is_terminated() for s in states):
            break
        host = fill_token_bitmask(states, compiler.vocab_size)
        batch = SamplingBatch.build(_params(4), [[0]] * 4, outs, [None] * 4, dev, token_bitmask=host,
                                    stage=stager.stage)
        ids = Sampler()(torch.randn(4, compiler.vocab_size, device=dev) * 3, batch).token_ids.tolist()
        for s, o, t in zip(states, outs, ids):
            if not s.is_terminated():
                assert s.accept(t)
                if not s.is_terminated():
                    o.append(t)
    for o in outs:
        jsonschema.validate(json.loads(tokenizer.decode(o)), SCHEMA)


def test_parallel_fill_matches_row_by_row(compiler, tokenizer):
    """Rows at different positions of different grammars (a terminated one and None rows among them): xgrammar's
    thread pool fills exactly what the row-by-row path does."""
    texts = ['{"name": "beta", "count": 1', '{"na', "", '{"name": "alpha", "count": -5, "ok": true, "inner": {']
    states = []
    for k in range(20):
        s = compiler.state(GrammarSpec.json_schema(SCHEMA) if k % 3 else GrammarSpec.regex("[0-9]{2}"))
        s.accept_tokens(tokenizer.encode(texts[k % 4] if k % 3 else "4", add_special_tokens=False))
        states.append(s if k % 5 else None)
    states[3].accept_tokens(tokenizer.encode("7", add_special_tokens=False) + [compiler.stop_token_ids[0]])
    assert states[3].is_terminated()
    serial = fill_token_bitmask(states, compiler.vocab_size)
    parallel = fill_token_bitmask(states, compiler.vocab_size, torch.zeros(24, compiler.bitmask_width,
                                                                           dtype=torch.int32), threads=2)
    assert torch.equal(serial, parallel) and len({tuple(r.tolist()) for r in serial}) > 4


def test_structural_tag_forces_a_marker_token_then_json(tokenizer):
    """A tool call's shape: a special marker token (by id), then arguments by JSON schema. The marker must be
    listed in grammar_special_tokens: special tokens are otherwise never allowed."""
    marker = special_token_ids(tiny_config()).role_ids["user"]
    args = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
            "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": marker}, {"type": "json_schema", "json_schema": args}]}}
    spec = GrammarSpec.structural_tag(tag)
    outs, done = _generate(StructuredOutputCompiler(tokenizer, grammar_special_tokens=[marker]), spec, seed=5,
                           rows=8)
    assert all(done) and all(o[0] == marker and marker not in o[1:] for o in outs)
    for o in outs:
        jsonschema.validate(json.loads(tokenizer.decode(o[1:])), args)
    state = StructuredOutputCompiler(tokenizer).state(spec)  # the marker blanked: nothing can start
    bm = allocate_token_bitmask(1, state.vocab_size)
    state.fill_bitmask(bm, 0)
    assert not _allowed_ids(bm[0], state.vocab_size)
