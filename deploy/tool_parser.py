"""MiniMax-M3 tool calls: the model's generated text -> content + OpenAI `tool_calls`, whole or streamed.

Syntax (../shared/M3_SPEC.md section 7): a namespace token NS = `]<]minimax[>[` precedes every structural tag.
One wrapper `NS<tool_call>`...`NS</tool_call>` holds `NS<invoke name="F">`...`NS</invoke>` calls; each argument
is an element named after it (`NS<city>Paris` + `NS</city>`), an object nested elements, an array `NS<item>`
elements; nulls are never written. Scalars are typed by the tool's JSON schema; NS right after an opening tag
means nested XML whatever the schema says. Hand-written: no maintained library parses this format (the public
parsers live inside serving engines), and it must stream token by token.

One incremental machine does both jobs (`parse_tool_calls` feeds it the whole text). It settles only what the
text so far decides and holds the rest (a possible NS, a tag without its `>`, an element not yet known to be a
scalar or nested), so every split gives the same result: content deltas concatenate to the parsed content and
each call's argument fragments to its `arguments`, written as `json.dumps` writes them (not ASCII-escaped). A
string value streams as it arrives; any other value when its element closes.

Contracts (never an exception, whatever the model wrote):
- Text outside a wrapper is content, verbatim (whitespace included; the caller may map blank content to None).
- A wrapper is tentative until its first complete `NS<invoke name="F">`: if anything else comes first (stray
  text, another tag, `</tool_call>`, the end), its raw text is content, so output without a readable call
  comes back whole as content.
- A call starts (id `call_` + 24 hex digits, and name, emitted) once its invoke tag is complete. Names are not
  checked against `tools`, as in vLLM: an unknown function's call is kept, every argument a string; refusing it
  is the caller's choice. Without `tools` every call is parsed that way too.
- Types: a schema's `type` (or list), `anyOf`/`oneOf`/`allOf` alternatives, or `enum`/`const` values give the
  allowed types; the text becomes the first that fits of integer, number, boolean, object (JSON), array
  (JSON), else stays the string written. Unknown arguments and typeless schemas are strings; `null` text is
  null only where the schema allows null and not string.
- Damage: whitespace between elements is dropped; a closing tag of an outer element (or `</tool_call>`) closes
  the inner ones; a new invoke closes the open call; NS not starting a closing tag of an open element is text
  inside a scalar; stray text and unknown tags between elements or invokes are content.
- Truncation (`finish()` inside a call): the call is closed to valid JSON: a string being streamed keeps what
  arrived, any other unfinished value is left out, open objects and arrays are closed; a partial tag at the
  end is dropped. (The caller sees `finish_reason` "length" and may drop the call.)
"""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

NS = "]<]minimax[>["
WRAPPER_OPEN = NS + "<tool_call>"
_TAG_LIMIT = 256  # longest tag body read between '<' and '>'; anything longer is text
_NAME = re.compile(r"[^\W\d][\w.\-:]*\Z")
_INVOKE = re.compile(r"""invoke\s+name\s*=\s*(?:"([^"]+)"|'([^']+)')\s*\Z""")
_INT = re.compile(r"[-+]?\d+\Z")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\Z")
_MORE = object()  # _read_tag: the text so far does not settle it
_FAIL = object()  # _as_type: the text is not of that type
_TEXT, _WRAPPER, _ARGS, _DONE = "text", "wrapper", "args", "done"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object as text (OpenAI's `function.arguments`)."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolParseResult:
    """Non-streaming result: `content` is the text outside the calls ("" when none)."""
    content: str
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: the first carries `id` and `name` (arguments ""), later ones carry
    `arguments` fragments only, as OpenAI streams them."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolStreamDelta:
    """What one `feed` or `finish` settled: content text and call pieces (header before fragments per call)."""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass
class _Frame:
    kind: str  # invoke | object | array | pending (kind not yet known) | scalar
    tag: str  # element name its closing tag carries
    schema: Any
    key: str | None  # JSON key it is written under; None for array items and the invoke
    count: int = 0  # children written so far (containers)
    streaming: bool = False  # scalar written as a JSON string while it arrives
    text: list[str] = field(default_factory=list)  # scalar text not yet written


@dataclass(frozen=True)
class _Tag:
    kind: str  # open | close | invoke | other
    name: str
    end: int  # index just past '>'


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix(buf: str, start: int, pattern: str) -> int:
    """Length of the longest suffix of buf[start:] that is a proper prefix of `pattern`."""
    for k in range(min(len(buf) - start, len(pattern) - 1), 0, -1):
        if buf.endswith(pattern[:k]):
            return k
    return 0


def _skip_ws(buf: str) -> int:
    return len(buf) - len(buf.lstrip())


def _read_tag(buf: str, pos: int) -> _Tag | None | object:
    """The structural tag NS<...> at buf[pos:]: a _Tag, None (not a tag), or _MORE (undecided yet)."""
    if not buf.startswith(NS, pos):
        return _MORE if NS.startswith(buf[pos:]) else None
    i = pos + len(NS)
    if i == len(buf):
        return _MORE
    if buf[i] != "<":
        return None
    j = buf.find(">", i + 1, i + 2 + _TAG_LIMIT)
    segment = buf[i + 1:j if j >= 0 else i + 2 + _TAG_LIMIT]
    if "<" in segment or "\n" in segment:
        return None
    if j < 0:
        return None if len(segment) > _TAG_LIMIT else _MORE
    if segment.startswith("/"):
        kind = "close" if _NAME.match(segment[1:]) else "other"
        return _Tag(kind, segment[1:], j + 1)
    m = _INVOKE.match(segment)
    if m:
        return _Tag("invoke", m.group(1) or m.group(2), j + 1)
    return _Tag("open" if _NAME.match(segment) else "other", segment, j + 1)


def _types(schema: Any, depth: int = 0) -> dict[str, Any]:
    """JSON types a schema allows, each with the (sub)schema allowing it; {} when it says nothing of types (or
    nests alternatives absurdly deep: request data must not reach the recursion limit)."""
    if not isinstance(schema, dict) or depth > 32:
        return {}
    out: dict[str, Any] = {}
    t = schema.get("type")
    for name in [t] if isinstance(t, str) else t if isinstance(t, list) else []:
        if isinstance(name, str):
            out.setdefault(name, schema)
    for combinator in ("anyOf", "oneOf", "allOf"):
        alternatives = schema.get(combinator)
        for sub in alternatives if isinstance(alternatives, list) else []:
            for name, s in _types(sub, depth + 1).items():
                out.setdefault(name, s)
    if not out:
        if isinstance(schema.get("properties"), dict):
            out["object"] = schema
        elif isinstance(schema.get("items"), dict):
            out["array"] = schema
        else:
            values = schema["enum"] if isinstance(schema.get("enum"), list) else (
                [schema["const"]] if "const" in schema else [])
            for v in values:
                name = ("null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int)
                        else "number" if isinstance(v, float) else "string" if isinstance(v, str) else None)
                if name:
                    out.setdefault(name, schema)
    return out


def _is_string(types: dict[str, Any]) -> bool:
    # Null is never written by the model (M3_SPEC), so Optional[str] streams as a string too.
    return not types or set(types) <= {"string", "null"}


def _reject(constant: str) -> Any:
    raise ValueError(constant)


def _as_type(kind: str, s: str) -> Any:
    try:
        if kind in ("integer", "number") and _INT.match(s):
            return int(s)
        if kind == "integer" and _NUMBER.match(s):
            f = float(s)
            return int(f) if math.isfinite(f) and f.is_integer() else _FAIL
        if kind == "number" and _NUMBER.match(s):
            f = float(s)
            return f if math.isfinite(f) else _FAIL
        if kind == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if kind in ("object", "array"):
            if not s:
                return {} if kind == "object" else []
            v = json.loads(s, parse_constant=_reject)  # NaN / Infinity are not JSON
            return v if isinstance(v, dict if kind == "object" else list) else _FAIL
    except (ValueError, RecursionError):
        pass
    return _FAIL


def convert_value(text: str, schema: Any) -> Any:
    """A scalar element's text as the JSON value its schema asks for (the rules in the module docstring)."""
    types = _types(schema)
    if _is_string(types):
        return text
    s = text.strip()
    if s == "null" and "null" in types and "string" not in types:
        return None
    for kind in ("integer", "number", "boolean", "object", "array"):
        if kind in types:
            v = _as_type(kind, s)
            if v is not _FAIL:
                return v
    return text


def _child_schema(parent: _Frame, tag: str) -> Any:
    schema = parent.schema if isinstance(parent.schema, dict) else {}
    if parent.kind == "array":
        return schema.get("items")
    props = schema.get("properties")
    if isinstance(props, dict) and tag in props:
        return props[tag]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _tool_schemas(tools: Any) -> dict[str, Any]:
    """{function name: parameters schema} from OpenAI tool dicts ({"type": "function", "function": {...}}) or
    bare function dicts ({"name", "parameters"})."""
    out: dict[str, Any] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.setdefault(fn["name"], fn.get("parameters"))
    return out


class ToolCallStreamParser:
    """Streaming parser: `feed(delta)` per text delta, then `finish()` once. Each returns a ToolStreamDelta;
    `tools` (OpenAI tool dicts) only type argument values."""

    def __init__(self, tools: Any = None):
        self._schemas = _tool_schemas(tools)
        self._buf = ""  # text not yet settled
        self._state = _TEXT
        self._raw = ""  # a tentative wrapper's raw text, content if it never holds a call
        self._committed = False
        self._in_stray = False  # stray text continues through whitespace until the next tag
        self._stack: list[_Frame] = []
        self._index = -1
        self._content: list[str] = []
        self._calls: list[list] = []  # [index, id, name, arguments pieces] per delta being built

    def feed(self, text: str) -> ToolStreamDelta:
        if self._state == _DONE:
            raise RuntimeError("ToolCallStreamParser: feed() after finish()")
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> ToolStreamDelta:
        """End of output: held text is settled (module docstring, "Truncation"); an open call is closed."""
        if self._state == _TEXT:
            self._emit(self._buf)
        elif self._state == _WRAPPER and not self._committed:
            self._emit(self._raw + self._buf)
        elif self._state == _ARGS:
            self._close_to(0, truncated=True)
        self._buf, self._state = "", _DONE
        return self._take()

    # -- output --------------------------------------------------------------------------------------------
    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _args(self, text: str) -> None:
        last = self._calls[-1] if self._calls else None
        if last is None or last[0] != self._index or last[1] is not None:
            last = [self._index, None, None, []]
            self._calls.append(last)
        last[3].append(text)

    def _take(self) -> ToolStreamDelta:
        out = ToolStreamDelta("".join(self._content),
                              tuple(ToolCallDelta(i, "".join(a), id_, name) for i, id_, name, a in self._calls))
        self._content, self._calls = [], []
        return out

    # -- the machine: each step settles what the buffer allows; False when it needs more text ---------------
    def _step(self) -> bool:
        if not self._buf:
            return False
        if self._state == _TEXT:
            return self._text()
        if self._state == _WRAPPER:
            return self._wrapper()
        top = self._stack[-1]
        if top.kind == "pending":
            return self._pending(top)
        if top.kind == "scalar":
            return self._scalar(top)
        return self._container(top)

    def _text(self) -> bool:
        buf = self._buf
        i = buf.find(NS)
        if i != 0:
            n = i if i > 0 else len(buf) - _partial_suffix(buf, 0, WRAPPER_OPEN)
            self._emit(buf[:n])
            self._buf = buf[n:]
            return i > 0
        if buf.startswith(WRAPPER_OPEN):
            self._raw, self._buf = WRAPPER_OPEN, buf[len(WRAPPER_OPEN):]
            self._state, self._committed = _WRAPPER, False
            return True
        if WRAPPER_OPEN.startswith(buf):
            return False
        self._emit(NS)
        self._buf = buf[len(NS):]
        return True

    def _stray(self, tag: _Tag | None) -> bool:
        """Text or a tag the grammar has no place for, between invokes or elements: content."""
        buf = self._buf
        if tag is not None:
            n = tag.end
        elif buf.startswith(NS):
            n = len(NS)
        else:
            i = buf.find(NS)
            n = i if i >= 0 else len(buf) - _partial_suffix(buf, 0, NS)
        self._emit(buf[:n])
        self._buf = buf[n:]
        self._in_stray = tag is None
        return n > 0

    def _next_tag(self) -> _Tag | None | object:
        """Between invokes or elements: drop whitespace (kept inside stray text), then read what follows."""
        if not self._in_stray:
            j = _skip_ws(self._buf)
            if not self._committed:
                self._raw += self._buf[:j]
            self._buf = self._buf[j:]
        return _read_tag(self._buf, 0)

    def _wrapper(self) -> bool:
        tag, buf = self._next_tag(), self._buf
        if tag is _MORE:
            return False
        if tag is not None and tag.kind == "invoke":
            self._raw, self._committed, self._buf = "", True, buf[tag.end:]
            self._start_call(tag.name)
            return True
        if not self._committed:  # no call yet: the wrapper was not one; its raw text is content
            end = tag.end if tag is not None and tag.kind == "close" and tag.name == "tool_call" else 0
            self._emit(self._raw + buf[:end])
            self._raw, self._buf, self._state = "", buf[end:], _TEXT
            return True
        if tag is not None and tag.kind == "close" and tag.name == "tool_call":
            self._buf, self._state, self._in_stray = buf[tag.end:], _TEXT, False
            return True
        return self._stray(tag)

    def _start_call(self, name: str) -> None:
        self._in_stray = False
        self._index += 1
        self._calls.append([self._index, new_call_id(), name, []])
        self._stack = [_Frame("invoke", "invoke", self._schemas.get(name), None)]
        self._state = _ARGS
        self._args("{")

    def _find(self, name: str) -> int | None:
        """Depth of the innermost open element a closing tag `name` closes; -1: `tool_call` closes the wrapper
        (after any argument of that name); None: it closes nothing."""
        for d in range(len(self._stack) - 1, -1, -1):
            if self._stack[d].tag == name:
                return d
        return -1 if name == "tool_call" else None

    def _close_tag(self, depth: int) -> None:
        self._close_to(max(depth, 0))
        if depth < 0:
            self._state = _TEXT

    def _close_to(self, depth: int, truncated: bool = False) -> None:
        while len(self._stack) > depth:
            f = self._stack[-1]
            if f.kind == "scalar" and f.streaming:
                self._args('"')
            elif f.kind in ("scalar", "pending") and not truncated:
                self._open_value(f, json.dumps(convert_value("".join(f.text), f.schema), ensure_ascii=False))
            elif f.kind in ("invoke", "object"):
                self._args("}")
            elif f.kind == "array":
                self._args("]")
            self._stack.pop()
        if depth == 0:
            self._state = _WRAPPER

    def _open_value(self, f: _Frame, text: str) -> None:
        parent = self._stack[-2]
        key = "" if f.key is None else json.dumps(f.key, ensure_ascii=False) + ": "
        self._args((", " if parent.count else "") + key + text)
        parent.count += 1

    def _container(self, top: _Frame) -> bool:
        tag, buf = self._next_tag(), self._buf
        if tag is _MORE:
            return False
        if tag is None or tag.kind == "other":
            return self._stray(tag)
        if tag.kind == "invoke":
            self._buf = buf[tag.end:]
            self._close_to(0)
            self._start_call(tag.name)
            return True
        self._in_stray = False
        if tag.kind == "open":
            self._buf = buf[tag.end:]
            self._stack.append(_Frame("pending", tag.name, _child_schema(top, tag.name),
                                      None if top.kind == "array" else tag.name))
            return True
        depth = self._find(tag.name)
        if depth is None:
            return self._stray(tag)
        self._buf = buf[tag.end:]
        self._close_tag(depth)
        return True

    def _pending(self, top: _Frame) -> bool:
        """Just after an opening tag: an opening tag next (after optional whitespace) makes it nested XML,
        anything else a scalar."""
        buf = self._buf
        j = _skip_ws(buf)
        tag = _read_tag(buf, j) if j < len(buf) else _MORE
        if tag is _MORE:
            return False
        if tag is not None and tag.kind == "open":
            types = _types(top.schema)
            if ("object" in types) != ("array" in types):
                kind = "object" if "object" in types else "array"
            else:
                kind = "array" if tag.name == "item" else "object"
            top.kind, top.schema = kind, types.get(kind)
            self._open_value(top, "{" if kind == "object" else "[")
            self._buf = buf[j:]
            return True
        top.kind = "scalar"
        top.streaming = _is_string(_types(top.schema))
        if top.streaming:
            self._open_value(top, '"')
        return True

    def _scalar(self, top: _Frame) -> bool:
        buf, pos = self._buf, 0
        while True:
            i = buf.find(NS, pos)
            if i < 0:
                n = len(buf) - _partial_suffix(buf, pos, NS)
                self._scalar_text(top, buf[:n])
                self._buf = buf[n:]
                return False
            tag = _read_tag(buf, i)
            if tag is _MORE:
                self._scalar_text(top, buf[:i])
                self._buf = buf[i:]
                return False
            if tag is not None and tag.kind == "close":
                depth = self._find(tag.name)
                if depth is not None:
                    self._scalar_text(top, buf[:i])
                    self._buf = buf[tag.end:]
                    self._close_tag(depth)
                    return True
            pos = i + 1

    def _scalar_text(self, top: _Frame, text: str) -> None:
        if not text:
            return
        if top.streaming:
            self._args(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            top.text.append(text)


def parse_tool_calls(text: str, tools: Any = None) -> ToolParseResult:
    """Parse a whole generated text (the same machine as streaming, fed at once)."""
    parser = ToolCallStreamParser(tools)
    content: list[str] = []
    calls: dict[int, list] = {}
    for delta in (parser.feed(text), parser.finish()):
        content.append(delta.content)
        for d in delta.tool_calls:
            entry = calls.setdefault(d.index, [d.id, d.name, []])
            entry[2].append(d.arguments)
    return ToolParseResult("".join(content),
                           tuple(ToolCall(id_, name, "".join(a)) for _, (id_, name, a) in sorted(calls.items())))
