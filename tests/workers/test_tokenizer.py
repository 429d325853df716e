"""Tokenizer: round trips, streaming detokenization that never splits a character, stop strings, chat template.

The fixture trains a small byte-level BPE with the `tokenizers` library (so multi-byte characters really are
split across tokens) and writes it in the Hugging Face layout the checkpoints use.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from workers.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string, stop_holdback

BOS, ROLE, END = "]~!b[", "]~b]", "[e~["
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set role = 'ai' if m['role'] == 'assistant' else m['role'] %}"
    "]~b]{{ role }}\n{{ m['content'] }}[e~[\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Serving large models needs paged attention and continuous batching.",
    "naïve café résumé — über straße",
    "日本語のテキストと中文文本",
    "emoji: 🦀🚀✨👍🏽 and more 🦀",
]


def write_byte_bpe_dir(out_dir: Path, *, vocab_size: int = 420) -> Path:
    """A byte-level BPE tokenizer + tokenizer_config.json (MiniMax-style special tokens and chat template)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, ROLE, END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": END, "special": True}, "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(ROLE)]}))
    return out_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_byte_bpe_dir(tmp_path_factory.mktemp("tok")))


def _stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], prompt=(), skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens=skip)
    deltas, i, c = [], 0, 0
    while i < len(ids):
        n = chunk_sizes[c % len(chunk_sizes)]
        deltas.append(detok.add(ids[i:i + n]))
        i, c = i + n, c + 1
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    assert detok.output_token_ids == ids
    return deltas


def test_special_tokens_and_ids(tokenizer):
    assert tokenizer.bos_token_id == tokenizer.backend.token_to_id(BOS)
    # tokenizer_config's eos plus generation_config's extra id, in that order, no duplicates
    assert tokenizer.eos_token_ids == (tokenizer.backend.token_to_id(END), tokenizer.backend.token_to_id(ROLE))
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert tokenizer.vocab_size == len(vocab) == max(vocab.values()) + 1 > 300
    assert tokenizer.special_token_ids == frozenset(tokenizer.backend.token_to_id(t) for t in (BOS, ROLE, END))
    ids = tokenizer.encode(f"{BOS}hi{END}")
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_ids[0]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"{BOS}hi{END}"


def test_multibyte_characters_are_split_across_tokens(tokenizer):
    # The premise of the streaming tests: some characters span several tokens, and a lone token of such a
    # character does not decode to a whole character.
    # 🦀 and 👍🏽 occur in the corpus, so BPE learned merges of partial characters (e.g. the bytes F0 9F).
    for ch in ("🦀", "👍🏽", "🐍", "漢", "ж"):
        ids = tokenizer.encode(ch)
        assert len(ids) > 1, ch
        assert "\ufffd" in tokenizer.decode(ids[:1])


unicode_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), max_codepoint=0x10FFFF), min_size=0, max_size=40
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=unicode_text)
def test_round_trip_random_unicode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=unicode_text, chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       prompt=st.sampled_from(["", "Hello ", "日本", "🦀"]))
def test_stream_equals_full_decode_and_never_splits_characters(tokenizer, text, chunks, prompt):
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids, chunks, prompt=tokenizer.encode(prompt))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in d for d in deltas), deltas


def test_emoji_bytes_held_back_until_complete(tokenizer):
    text = "ok 🐍 漢 語!"  # 🐍 and 漢 are split into single-byte tokens by this vocabulary
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt "))
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == text
    # Some tokens produced nothing (held back), and every delta is whole characters that occur in the text.
    assert "" in deltas
    assert all(d in text for d in deltas)
    assert any("🐍" in d for d in deltas) and any("漢" in d for d in deltas)


def test_stream_with_special_tokens(tokenizer):
    ids = tokenizer.encode(f"a🦀{END}b")
    assert "".join(_stream(tokenizer, ids, [1])) == "a🦀b"
    assert "".join(_stream(tokenizer, ids, [1], skip=False)) == f"a🦀{END}b"


def test_truncated_character_is_released_by_flush(tokenizer):
    ids = tokenizer.encode("x🦀")
    cut = ids[:-1]  # generation ended mid-character
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.add([t]) for t in cut)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tokenizer.decode(cut)
    assert detok.flush() == ""


def test_find_stop_string_straddling_tokens(tokenizer):
    rng = random.Random(0)
    text = "The answer is 42.\nUser: next question 🦀 END here"
    ids = tokenizer.encode(text)
    stops = ["\nUser:", "🦀 END", "never"]
    detok = IncrementalDetokenizer(tokenizer, [])
    found, i = None, 0
    while i < len(ids) and found is None:
        n = rng.randint(1, 2)
        start = len(detok.output_text)
        detok.add(ids[i:i + n])
        i += n
        found = find_stop_string(detok.output_text, stops, start)
    assert found == (text.index("\nUser:"), "\nUser:")
    # Found as soon as the text containing it exists: the text emitted before the last add had no stop in it.
    assert "\nUser:" not in detok.output_text[: start + len("\nUser:") - 1] or start > text.index("\nUser:")
    # Straddling: the stop begins before new_text_start and ends after it.
    t = "abc 🦀 END"
    assert find_stop_string(t, stops, t.index("END")) == (t.index("🦀"), "🦀 END")
    # Only stops that end in the new text are reported; earliest start wins; ties go to the longer stop.
    assert find_stop_string("xx STOP yy", ["STOP"], 8) is None
    assert find_stop_string("a STOP b ST", ["ST", "STOP", " b"], 2) == (2, "STOP")
    assert find_stop_string("a STOP b", ["b", "OP"], 0) == (4, "OP")
    assert stop_holdback(["\nUser:", "x"]) == 5 and stop_holdback([]) == 0


def test_chat_template_system_user_assistant(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🦀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "More"}, {"type": "text", "text": "?"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        f"{BOS}{ROLE}system\nBe brief.{END}\n{ROLE}user\nHi 🦀{END}\n{ROLE}ai\nHello.{END}\n"
        f"{ROLE}user\nMore?{END}\n{ROLE}ai\n"
    )
    no_gen = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False)
    assert no_gen == f"{BOS}{ROLE}system\nBe brief.{END}\n{ROLE}user\nHi 🦀{END}\n"
    ids = tokenizer.encode_chat(messages[:2])
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.backend.token_to_id(ROLE)) == 3
    assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.apply_chat_template(messages[:2])
    with pytest.raises(ValueError, match="messages.content"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_is_sandboxed_and_supports_hf_helpers(tmp_path):
    d = write_byte_bpe_dir(tmp_path / "t")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages | tojson }}{% if messages|length > 1 %}"
                                        "{{ raise_exception('one message only') }}{% endif %}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == '[{"role": "user", "content": "é<b>"}]'
    with pytest.raises(Exception, match="one message only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    # The sandbox refuses attribute access to Python internals.
    cfg["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "a"}])
    # A chat_template.jinja file is used when the config has none; no template at all is a named error.
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "a"}])
    (d / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "a"}]) == "<a>"


# --- the tokenizer the project's checkpoints ship (msa.checkpoint), checked against transformers -------------

@pytest.fixture(scope="module")
def checkpoint_tokenizer_dir(tmp_path_factory) -> Path:
    from msa.checkpoint import write_tokenizer
    from workers.models import preset_config

    out = tmp_path_factory.mktemp("ckpt_tok")
    config = preset_config("tiny")
    write_tokenizer(config, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(config.eos_token_id)}))
    return out


def test_checkpoint_tokenizer_matches_transformers(checkpoint_tokenizer_dir):
    from transformers import AutoTokenizer

    from workers.models import preset_config

    config = preset_config("tiny")
    ours = Tokenizer.from_dir(checkpoint_tokenizer_dir)
    ref = AutoTokenizer.from_pretrained(str(checkpoint_tokenizer_dir))
    assert ours.vocab_size == config.vocab_size
    assert ours.bos_token_id == config.bos_token_id
    assert ours.eos_token_ids == tuple(config.eos_token_id)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie geht's? 你好 🙂"},
        {"role": "assistant", "content": "Gut."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "now?"}]},
    ]
    for gen in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    sample = "Hello world! 机器学习 🚀 — def f(x): return x"
    assert ours.encode(sample) == ref.encode(sample, add_special_tokens=False)
    ids = ours.encode_chat(messages)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    # Streaming a completion on this tokenizer equals its full decode.
    completion = ours.encode("Sure 🙂 机器 ok")
    assert "".join(_stream(ours, completion, [1], prompt=ids)) == "Sure 🙂 机器 ok"
