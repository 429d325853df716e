"""The MiniMax-M3 tool-call parser (deploy/tool_parser.py): exact values on the M3 syntax, damaged and truncated
output, and streaming at every split equal to the whole-text parse."""
from __future__ import annotations

import json
import random
import re

import pytest

from deploy.tool_parser import NS, ToolCallStreamParser, ToolStreamDelta, convert_value, parse_tool_calls

ID = re.compile(r"call_[0-9a-f]{24}\Z")


def el(tag: str, inner: str) -> str:
    return f"{NS}<{tag}>{inner}{NS}</{tag}>"


def invoke(name: str, *args: str) -> str:
    return f'{NS}<invoke name="{name}">' + "".join(args) + f"{NS}</invoke>"


def wrap(*invokes: str) -> str:
    return f"{NS}<tool_call>\n" + "\n".join(invokes) + f"\n{NS}</tool_call>"


def fn(name: str, properties: dict, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, **extra}}}


TOOLS = [
    fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                       "lat": {"type": "number"}}),
    fn("search", {"q": {"type": "string"}, "filters": {"type": "array", "items": {"type": "string"}},
                  "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}),
    fn("book", {"trip": {"type": "object", "properties": {
        "from": {"type": "string"}, "seats": {"type": "integer"},
        "legs": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "integer"}, "flex": {"type": "boolean"}}}}}}}),
]

SPEC_EXAMPLE = wrap(invoke("get_weather", el("city", "Paris")),
                    invoke("search", el("q", "rain"), el("filters", el("item", "news"))))
FULL = "Let me check.\n" + wrap(
    invoke("get_weather", el("city", "Paris"), el("days", "3"), el("metric", "true"), el("lat", "48.85")),
    invoke("book", el("trip", el("from", 'Gare "du" Nord\\') + el("seats", "2")
                      + el("legs", el("item", el("day", "1")) + el("item", el("day", "2") + el("flex", "false"))))),
    invoke("search", el("q", "rain ] < [ 雨"), el("filters", el("item", "news") + el("item", "blogs")),
           el("limit", "5")))
FULL_CALLS = [
    ("get_weather", '{"city": "Paris", "days": 3, "metric": true, "lat": 48.85}'),
    ("book", '{"trip": {"from": "Gare \\"du\\" Nord\\\\", "seats": 2, '
             '"legs": [{"day": 1}, {"day": 2, "flex": false}]}}'),
    ("search", '{"q": "rain ] < [ 雨", "filters": ["news", "blogs"], "limit": 5}'),
]


def calls_of(result) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.tool_calls]


def stream(pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """Feed `pieces`, check the OpenAI delta shape, and accumulate as a client would."""
    parser = ToolCallStreamParser(tools)
    content, calls, ids = [], {}, []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.index == len(calls) and d.arguments == "" and d.name and ID.match(d.id), d
                calls[d.index] = [d.name, ""]
                ids.append(d.id)
            else:
                assert d.id is None and d.name is None and d.arguments, d
                calls[d.index][1] += d.arguments
    assert len(set(ids)) == len(ids)
    return "".join(content), [tuple(v) for v in calls.values()]


def assert_stream_equal(text: str, tools=TOOLS, seeds: int = 20) -> None:
    whole = parse_tool_calls(text, tools)
    expected = (whole.content, calls_of(whole))
    assert stream(list(text), tools) == expected
    for p in range(len(text) + 1):
        assert stream([text[:p], text[p:]], tools) == expected, p
    for seed in range(seeds):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert stream(pieces, tools) == expected, seed


# -- whole-text parsing -------------------------------------------------------------------------------------

def test_spec_example_two_invokes_in_one_wrapper():
    r = parse_tool_calls(SPEC_EXAMPLE, TOOLS)
    assert r.content == ""
    assert calls_of(r) == [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "rain", "filters": ["news"]}')]
    assert all(ID.match(c.id) for c in r.tool_calls) and r.tool_calls[0].id != r.tool_calls[1].id


def test_text_before_the_call_nested_objects_arrays_and_typed_values():
    r = parse_tool_calls(FULL, TOOLS)
    assert r.content == "Let me check.\n"
    assert calls_of(r) == FULL_CALLS
    for _, args in FULL_CALLS:  # written as json.dumps writes them
        assert json.dumps(json.loads(args), ensure_ascii=False) == args


def test_text_after_the_wrapper_is_content():
    r = parse_tool_calls("A" + SPEC_EXAMPLE + "\nB", TOOLS)
    assert r.content == "A\nB" and len(r.tool_calls) == 2


def _deep(schema: dict, depth: int) -> dict:
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


@pytest.mark.parametrize("schema, text, value", [
    ({"type": "integer"}, " 42\n", 42),
    ({"type": "integer"}, "3.0", 3),
    ({"type": "integer"}, "3.5", "3.5"),
    ({"type": "integer"}, "many", "many"),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "-7", -7),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "number"}, "nan", "nan"),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "false", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "string"}, " 007 ", " 007 "),
    ({"type": ["string", "null"]}, "null", "null"),
    ({"type": ["integer", "null"]}, "null", None),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "12", 12),
    ({"type": ["number", "string"]}, "abc", "abc"),
    ({"type": ["boolean", "integer"]}, "1", 1),
    ({"enum": [1, 2, 3]}, "2", 2),
    ({"enum": ["a", "b"]}, "2", "2"),
    ({"type": "object"}, '{"a": [1]}', {"a": [1]}),
    ({"type": "object"}, "[1]", "[1]"),
    ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "array"}, "", []),
    ({"type": "object"}, "{bad", "{bad"),
    ({"type": "object"}, '{"a": NaN}', '{"a": NaN}'),
    (_deep({"type": "integer"}, 2000), "7", "7"),
    (_deep({"type": "integer"}, 20), "7", 7),
    ({}, "5", "5"),
    (None, "true", "true"),
])
def test_scalar_values_typed_by_schema(schema, text, value):
    assert convert_value(text, schema) == value and type(convert_value(text, schema)) is type(value)


def test_values_through_the_parser_and_nulls_omitted():
    tools = [fn("f", {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "s": {"type": "string"},
                      "o": {"type": "object"}, "a": {"type": "array"}, "e": {"type": "string"}},
                required=["n"])]
    text = wrap(invoke("f", el("n", "-3"), el("o", '{"k": null}'), el("a", ""), el("e", ""),
                       el("s", 'say "hi"\n\\o/ 🙂')))
    assert calls_of(parse_tool_calls(text, tools)) == [
        ("f", '{"n": -3, "o": {"k": null}, "a": [], "e": "", "s": "say \\"hi\\"\\n\\\\o/ 🙂"}')]
    assert_stream_equal(text, tools, seeds=5)


def test_namespace_after_an_opening_tag_means_nested_whatever_the_schema():
    tools = [fn("f", {"s": {"type": "string"}, "n": {"type": "integer"}})]
    text = wrap(invoke("f", el("s", el("a", "1") + el("b", "x")), el("n", el("item", "7"))))
    assert calls_of(parse_tool_calls(text, tools)) == [("f", '{"s": {"a": "1", "b": "x"}, "n": ["7"]}')]


def test_schema_decides_object_or_array_and_additional_properties_type_values():
    tools = [fn("f", {"m": {"type": "object", "additionalProperties": {"type": "integer"}},
                      "l": {"type": "array", "items": {"type": "number"}},
                      "u": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]}})]
    text = wrap(invoke("f", el("m", el("item", "1") + el("b", "2")), el("l", el("x", "1.5") + el("y", "2")),
                       el("u", el("item", "4"))))
    assert calls_of(parse_tool_calls(text, tools)) == [("f", '{"m": {"item": 1, "b": 2}, "l": [1.5, 2], "u": [4]}')]


def test_no_tools_and_unknown_names_and_arguments_are_kept_as_strings():
    text = wrap(invoke("nope", el("n", "3"), el("obj", el("k", "true")), el("arr", el("item", "1"))),
                invoke("get_weather", el("city", "Oslo"), el("extra", "9"), el("days", "2")))
    expected = [("nope", '{"n": "3", "obj": {"k": "true"}, "arr": ["1"]}'),
                ("get_weather", '{"city": "Oslo", "extra": "9", "days": 2}')]
    assert calls_of(parse_tool_calls(text, TOOLS)) == expected
    untyped = [("nope", expected[0][1]), ("get_weather", '{"city": "Oslo", "extra": "9", "days": "2"}')]
    assert calls_of(parse_tool_calls(text, None)) == untyped
    assert calls_of(parse_tool_calls(text, [])) == untyped


def test_call_with_no_arguments_and_whitespace_between_elements():
    text = (f'{NS}<tool_call>{NS}<invoke name="now">\n{NS}</invoke>'
            f'{NS}<invoke name="f">\n  {el("a", "x")}\n{NS}</invoke>{NS}</tool_call>')
    assert calls_of(parse_tool_calls(text)) == [("now", "{}"), ("f", '{"a": "x"}')]
    assert parse_tool_calls(text).content == ""


@pytest.mark.parametrize("text", [
    "plain answer, no call",
    f"a {NS} b {NS}<x> c ]<]mini",
    '<tool_call><invoke name="f"><a>1</a></invoke></tool_call>',
    f"{NS}<tool_call>\n{NS}</tool_call>",
    f"{NS}<tool_call>oops {invoke('f', el('a', '1'))}{NS}</tool_call>",
    f"{NS}<tool_call>\n{NS}<call name=\"f\">{NS}</call>{NS}</tool_call> after",
    f'{NS}<tool_call>{NS}<invoke name="">{NS}</invoke>',
    f"{NS}<tool_call>{NS}<" + "x" * 300 + ">",
    f"{NS}<tool_call>\n",
    f'x{NS}<tool_call>{NS}<invoke name="f',
])
def test_nothing_readable_comes_back_whole_as_content(text):
    r = parse_tool_calls(text, TOOLS)
    assert (r.content, r.tool_calls) == (text, ())
    assert_stream_equal(text, seeds=3)


def test_damaged_calls_are_read_where_readable():
    cases = [
        # a missing </city> is closed by </invoke>; a missing </invoke> by the next invoke or </tool_call>
        (wrap(f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</invoke>',
              f'{NS}<invoke name="search">{el("q", "x")}'),
         "", [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "x"}')]),
        # a closing tag of no open element is literal text inside a scalar
        (wrap(invoke("f", el("a", f"x{NS}</b>y"))), "", [("f", f'{{"a": "x{NS}</b>y"}}')]),
        # stray text and unknown tags between invokes and elements are content
        (wrap(invoke("f", el("a", "1"), "junk", f"{NS}<bad tag>", f"{NS}</zz>"), "more", f"{NS}<w x>"),
         f"junk{NS}<bad tag>{NS}</zz>more\n{NS}<w x>", [("f", '{"a": "1"}')]),
        # no </tool_call>: the calls stand and later text is content
        (f'{NS}<tool_call>{invoke("f", el("a", "1"))}\nDone.', "Done.", [("f", '{"a": "1"}')]),
        # a second wrapper is read too
        (SPEC_EXAMPLE + "\n" + wrap(invoke("f")), "\n",
         [("get_weather", '{"city": "Paris"}'), ("search", '{"q": "rain", "filters": ["news"]}'), ("f", "{}")]),
        # </tool_call> inside an element closes everything
        (f'{NS}<tool_call>{NS}<invoke name="f">{NS}<o>{NS}<a>1{NS}</tool_call>tail', "tail",
         [("f", '{"o": {"a": "1"}}')]),
        # single-quoted invoke name, whitespace after an opening tag before nested XML
        (wrap(f"{NS}<invoke name='f'>{NS}<o>\n {el('k', 'v')}{NS}</o>{NS}</invoke>"), "", [("f", '{"o": {"k": "v"}}')]),
    ]
    for text, content, calls in cases:
        r = parse_tool_calls(text, TOOLS)
        assert (r.content, calls_of(r)) == (content, calls), text
        assert_stream_equal(text, seeds=3)


# -- truncation ---------------------------------------------------------------------------------------------

def test_truncated_output_at_every_prefix():
    """Never raises, never a call that is not in the text: a call appears once its invoke tag is complete, its
    arguments are always valid JSON, and each call is exact once its </invoke> is in the prefix."""
    ends = [m.end() for m in re.finditer(re.escape(f"{NS}</invoke>"), FULL)]
    first_invoke = FULL.index('">', FULL.index("<invoke")) + 2
    for k in range(len(FULL) + 1):
        r = parse_tool_calls(FULL[:k], TOOLS)
        if k < first_invoke:
            assert (r.content, r.tool_calls) == (FULL[:k], ())
            continue
        assert r.content == "Let me check.\n"
        names = [c.name for c in r.tool_calls]
        assert names == [n for n, _ in FULL_CALLS[:len(names)]] and names
        for i, c in enumerate(r.tool_calls):
            args = json.loads(c.arguments)
            full = json.loads(FULL_CALLS[i][1])
            assert set(args) <= set(full)
            if i < len(ends) and ends[i] <= k:
                assert c.arguments == FULL_CALLS[i][1]
        # typed (non-string) values appear only complete
        if len(names) == 1 and "days" in json.loads(r.tool_calls[0].arguments):
            assert json.loads(r.tool_calls[0].arguments)["days"] == 3


def test_truncated_values_exactly():
    call = f'{NS}<tool_call>{NS}<invoke name="get_weather">'
    cases = [
        (call, "{}"),
        (call + f"{NS}<city>Par", '{"city": "Par"}'),  # a streamed string keeps what arrived
        (call + f"{NS}<city>Paris{NS}</ci", '{"city": "Paris"}'),  # a partial tag is dropped
        (call + f"{NS}<city>Paris]<]mini", '{"city": "Paris"}'),
        (call + el("city", "P") + f"{NS}<days>1", '{"city": "P"}'),  # an incomplete integer is left out
        (call + el("city", "P") + f"{NS}<days>", '{"city": "P"}'),
        (call + f'{NS}<trip>{NS}<legs>{NS}<item>{NS}<day>4', '{"trip": {"legs": [{"day": "4"}]}}'),
    ]
    for text, args in cases:
        assert calls_of(parse_tool_calls(text, TOOLS)) == [("get_weather", args)], text
    book = f'{NS}<tool_call>{NS}<invoke name="book">{NS}<trip>{NS}<legs>{NS}<item>{el("day", "4")}{NS}<flex>tr'
    assert calls_of(parse_tool_calls(book, TOOLS)) == [("book", '{"trip": {"legs": [{"day": 4}]}}')]


def test_streaming_every_prefix_equals_whole_parse():
    for k in range(0, len(FULL) + 1, 3):
        text = FULL[:k]
        whole = parse_tool_calls(text, TOOLS)
        assert stream(list(text)) == (whole.content, calls_of(whole)), k


# -- streaming ----------------------------------------------------------------------------------------------

def test_streaming_split_anywhere_equals_whole_parse():
    assert_stream_equal(SPEC_EXAMPLE)
    assert_stream_equal(FULL, seeds=100)


def test_streaming_sends_string_values_as_they_arrive():
    parser = ToolCallStreamParser(TOOLS)
    head = parser.feed(f'Hi{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Par')
    assert head.content == "Hi"
    assert [(d.index, d.name, d.arguments) for d in head.tool_calls] == [
        (0, "get_weather", ""), (0, None, '{"city": "Par')]
    held = parser.feed("is]<]mini")  # "]<]mini" may start a tag: held
    assert [d.arguments for d in held.tool_calls] == ["is"]
    assert [d.arguments for d in parser.feed(f"max[>[</city>{NS}<days>1").tool_calls] == ['"']
    assert [d.arguments for d in parser.feed(f"2{NS}</days>").tool_calls] == [', "days": 12']
    assert [d.arguments for d in parser.feed(f"{NS}</invoke>").tool_calls] == ["}"]
    assert parser.finish() == ToolStreamDelta()


def test_feed_after_finish_is_an_error():
    parser = ToolCallStreamParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_random_fragment_soup_never_raises_and_streams_the_same():
    """Texts built from the grammar's pieces in random order (damaged on purpose): every call's arguments are a
    JSON object and any split streams to the whole-text parse."""
    pieces = [NS, f"{NS}<tool_call>", f"{NS}</tool_call>", f'{NS}<invoke name="get_weather">',
              f'{NS}<invoke name="book">', f"{NS}</invoke>", f"{NS}<city>", f"{NS}</city>", f"{NS}<days>",
              f"{NS}</days>", f"{NS}<trip>", f"{NS}</trip>", f"{NS}<legs>", f"{NS}</legs>", f"{NS}<item>",
              f"{NS}</item>", f"{NS}<day>", f"{NS}</day>", f"{NS}<x y>", "Paris", "12", "true", " ", "\n", "]",
              "<", '"', "\\", "é", "]<]mini", "max[>["]
    calls = 0
    for seed in range(300):
        rng = random.Random(seed)
        start = rng.choice(["", f'{NS}<tool_call>{NS}<invoke name="book">{NS}<trip>'])
        text = start + "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        whole = parse_tool_calls(text, TOOLS)
        calls += len(whole.tool_calls)
        for c in whole.tool_calls:
            assert isinstance(json.loads(c.arguments), dict), (seed, c)
        expected = (whole.content, calls_of(whole))
        assert stream(list(text)) == expected, seed
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        assert stream([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]) == expected, seed
    assert calls > 150  # the soup does reach the calls


def test_arguments_named_like_structural_tags():
    tools = [fn("f", {"tool_call": {"type": "integer"}, "invoke": {"type": "object"}, "item": {"type": "string"}})]
    text = wrap(invoke("f", el("tool_call", "1"), el("invoke", el("invoke", "x")), el("item", "y")))
    assert calls_of(parse_tool_calls(text, tools)) == [
        ("f", '{"tool_call": 1, "invoke": {"invoke": "x"}, "item": "y"}')]
    assert_stream_equal(text, tools, seeds=3)
