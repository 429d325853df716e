"""What a request asks its output to follow (`GrammarSpec`), kept apart from the machinery that compiles and
applies it (workers/structured.py, which needs torch and xgrammar): the serving layer builds specs from HTTP
bodies without importing either."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

KINDS = ("json_object", "json_schema", "choice", "regex", "grammar", "structural_tag")
# Whitespace allowed between JSON tokens. Unlimited whitespace lets a model loop on newlines until max_tokens (a
# known failure mode in vLLM, hence its `disable_any_whitespace`); 16 still fits pretty-printing a few levels deep.
MAX_JSON_WHITESPACE = 16


class GrammarError(ValueError):
    """A spec that cannot be compiled (invalid schema, regex or grammar): a client error (HTTP 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint. `kind` in KINDS; `spec` is canonical text: a JSON schema serialised with its key
    order kept (property order is output order), a choice list as a JSON array, regex / EBNF as given.
    `source`: the request field it came from (e.g. "response_format"), named by compile errors; not part of
    the cache key."""

    kind: str
    spec: str = ""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"structured output: unknown kind {self.kind!r} (expected one of {KINDS})")

    @classmethod
    def json_object(cls, *, source: str = "") -> "GrammarSpec":
        return cls("json_object", source=source)

    @classmethod
    def json_schema(cls, schema: dict | str, *, source: str = "") -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema: not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema: expected an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), source=source)

    @classmethod
    def choice(cls, choices: Sequence[str], *, source: str = "") -> "GrammarSpec":
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice: expected a non-empty list of strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), source=source)

    @classmethod
    def regex(cls, pattern: str, *, source: str = "") -> "GrammarSpec":
        return cls("regex", pattern, source=source)

    @classmethod
    def grammar(cls, ebnf: str, *, source: str = "") -> "GrammarSpec":
        """An EBNF grammar in xgrammar's (GBNF-like) syntax with a `root` rule."""
        return cls("grammar", ebnf, source=source)

    @classmethod
    def structural_tag(cls, tag: dict | str, *, source: str = "") -> "GrammarSpec":
        """An xgrammar structural tag ({"type": "structural_tag", "format": {...}}): sequences of literal text,
        single tokens by id, JSON schemas, regexes and grammars; vLLM's `structural_tag` response format."""
        if isinstance(tag, dict):
            tag = json.dumps(tag, ensure_ascii=False, separators=(",", ":"))
        return cls("structural_tag", tag, source=source)


__all__ = ["KINDS", "MAX_JSON_WHITESPACE", "GrammarError", "GrammarSpec"]
