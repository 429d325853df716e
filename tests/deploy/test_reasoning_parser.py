"""The MiniMax-M3 reasoning split (deploy/reasoning_parser.py): both modes, tags alone or missing, truncated
thinking, and streaming at every split equal to the whole-text split."""
from __future__ import annotations

import random

import pytest

from deploy.reasoning_parser import (
    ReasoningDelta, ReasoningStreamParser, parse_reasoning, prompt_starts_in_reasoning,
)

O, C = "<mm:think>", "</mm:think>"

CASES = [
    # (text, starts_in_reasoning, reasoning, content)
    (f"Let me think.\n{C}\n\nParis.", True, "Let me think.\n", "\n\nParis."),
    (f"{O}\nplan{C}answer", False, "\nplan", "answer"),
    (f"\n {O}plan{C}answer", False, "plan", "answer"),
    (f"{O}plan{C}answer", True, "plan", "answer"),  # a redundant opening tag is skipped
    (f"  plan{C}answer", True, "  plan", "answer"),
    (f"{C}\n\nHello", False, None, "\n\nHello"),  # thinking off: the closing tag alone
    (f"\n{C}Hi", False, None, "Hi"),
    ("Hello, no tags.", False, None, "Hello, no tags."),
    (f"Hi {O}x{C} y", False, None, f"Hi {O}x{C} y"),  # tags later in content are text
    ("still thinking, cut off", True, "still thinking, cut off", ""),
    (f"cut inside a tag </mm:th", True, "cut inside a tag </mm:th", ""),
    (f"{O}open but cut", False, "open but cut", ""),
    (f"{C}x", True, None, "x"),  # empty reasoning is None
    (f"{O}{C}x", False, None, "x"),
    (f"a{C}b{C}c", True, "a", f"b{C}c"),
    (f"a{O}b{C}c", True, f"a{O}b", "c"),
    ("", True, None, ""),
    ("", False, None, ""),
    ("   ", False, None, "   "),
    ("   ", True, "   ", ""),
    ("<mm:thi", False, None, "<mm:thi"),
    ("</mm:thi", True, "</mm:thi", ""),
    (f"<mm:thinking>{C}", False, None, f"<mm:thinking>{C}"),
    (f"思考{C}答え🙂", True, "思考", "答え🙂"),
]


@pytest.mark.parametrize("text, starts_in, reasoning, content", CASES)
def test_parse(text, starts_in, reasoning, content):
    r = parse_reasoning(text, starts_in_reasoning=starts_in)
    assert (r.reasoning, r.content) == (reasoning, content)


def stream(pieces: list[str], starts_in: bool) -> tuple[str | None, str]:
    parser = ReasoningStreamParser(starts_in_reasoning=starts_in)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    return reasoning or None, "".join(d.content for d in deltas)


@pytest.mark.parametrize("text, starts_in, reasoning, content", CASES)
def test_streaming_split_anywhere_equals_parse(text, starts_in, reasoning, content):
    expected = (reasoning, content)
    assert stream(list(text), starts_in) == expected
    for p in range(len(text) + 1):
        assert stream([text[:p], text[p:]], starts_in) == expected, p
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        assert stream([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])], starts_in) == expected, seed


def test_streaming_holds_only_what_may_be_a_tag():
    p = ReasoningStreamParser(starts_in_reasoning=True)
    assert p.feed("abc</mm") == ReasoningDelta("abc", "")
    assert p.feed(":thi") == ReasoningDelta()
    assert p.feed("nk>\n\nAns") == ReasoningDelta("", "\n\nAns")
    assert p.feed("wer </mm:think>") == ReasoningDelta("", "wer </mm:think>")
    assert p.finish() == ReasoningDelta()
    off = ReasoningStreamParser()
    assert off.feed("\n") == ReasoningDelta()  # whitespace may precede a start tag: held
    assert off.feed("</mm:") == ReasoningDelta()
    assert off.feed("think>Hi") == ReasoningDelta("", "Hi")
    plain = ReasoningStreamParser()
    assert plain.feed("\nH") == ReasoningDelta("", "\nH")
    plain.finish()
    with pytest.raises(RuntimeError):
        plain.feed("x")


def test_random_tag_soup_streams_the_same():
    pieces = [O, C, "<mm:", "think>", "</", "a", " ", "\n", "<", ">", "é"]
    for seed in range(300):
        rng = random.Random(seed)
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for starts_in in (False, True):
            whole = parse_reasoning(text, starts_in)
            assert stream(list(text), starts_in) == (whole.reasoning, whole.content), (seed, text)


def test_prompt_starts_in_reasoning():
    assert prompt_starts_in_reasoning("<|assistant|>\n<mm:think>\n")
    assert not prompt_starts_in_reasoning("<|assistant|>\n")
    assert not prompt_starts_in_reasoning("<mm:think>x</mm:think>\n<|assistant|>\n")
