"""Tokenizer for serving: `tokenizers` (tokenizer.json) + tokenizer_config.json, chat templates, streaming
detokenization that never splits a UTF-8 character, and stop-string search across token boundaries.

No `transformers` at serving time: the ingress tokenizes with the Rust `tokenizers` library directly and renders
chat templates in a sandboxed jinja2 environment configured the way Hugging Face chat templates expect.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import jinja2
import tokenizers
from tokenizers.decoders import DecodeStream
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Prompt tokens given to the streaming detokenizer as left context (tokenizers whose decode of a token depends
# on its left neighbour, e.g. leading-space handling, need a few).
_DETOKENIZE_CONTEXT_TOKENS = 5


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string, an AddedToken dict {"content": ...}, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token: expected a string or {{'content': ...}}, got {value!r}")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _select_chat_template(config: dict, model_dir: Path) -> str | None:
    """The default chat template: tokenizer_config's `chat_template` (a string, or a list of named templates
    where "default" wins), else a chat_template.jinja file beside it (transformers >= 4.43 saves it there)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or (template[0]["template"] if template else None)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Hugging Face templates call `tojson` with these keywords; jinja2's built-in escapes HTML, which would
    # corrupt prompts, so it is replaced.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], keep_trailing_newline=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _normalise_message(message: dict) -> dict:
    """OpenAI-style content parts [{"type": "text", "text": ...}] become one string (this model is text-only
    on the serving path); other part types are rejected."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"messages.content: only text parts are supported, got {kind!r}")
        texts.append(part.get("text", ""))
    return {**message, "content": "".join(texts)}


class Tokenizer:
    """A model directory's tokenizer: `Tokenizer.from_dir(model_dir)`."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict, *, chat_template: str | None = None,
                 extra_eos_token_ids: Sequence[int] = ()) -> None:
        self._tok = backend
        self.config = config
        self.chat_template = chat_template
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.bos_token_id = self._id_of("bos_token", self.bos_token)
        eos_ids = [] if self.eos_token is None else [self._id_of("eos_token", self.eos_token)]
        for tid in extra_eos_token_ids:
            if tid not in eos_ids:
                eos_ids.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Read tokenizer.json, tokenizer_config.json and (if present) generation_config.json's eos_token_id."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json: not found in {model_dir}")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        gen_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        extra = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
        return cls(backend, config, chat_template=_select_chat_template(config, model_dir), extra_eos_token_ids=extra)

    def _id_of(self, name: str, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{name}: {token!r} is not in the vocabulary")
        return tid

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. by a chat template) become their ids;
        `add_special_tokens` additionally applies the tokenizer's post-processor (e.g. a leading BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level BPE: its byte-to-unicode spelling, not readable text)."""
        return self._tok.id_to_token(token_id)

    def decode_token(self, token_id: int) -> str:
        """One token as text (for logprob listings; may hold U+FFFD where the token is part of a character)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render the chat template. Extra keyword arguments (e.g. `tools`) are template variables."""
        if not self.chat_template:
            raise ValueError("chat_template: this tokenizer has none (tokenizer_config.json / chat_template.jinja)")
        template = self._compiled_template
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            "tools": None,
            **template_kwargs,
            "messages": [_normalise_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        return template.render(**context)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Render then tokenize; the template writes its own special tokens, so none are added."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        return _compile_template(self.chat_template)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas as they arrive, for streaming.

    Each token goes through `tokenizers.decoders.DecodeStream` (the Rust side keeps the decode window: one call per
    token, no re-decoding of earlier text), seeded with the prompt's last tokens as left context (leading-space
    handling depends on the left neighbour). A token that ends inside a UTF-8 character (byte-level BPE splits
    multi-byte characters across tokens) yields nothing until a later token completes it, so no delta ever holds
    part of a character. `flush()` at the end releases what is still held (as U+FFFD, the same text a full decode
    gives), so the deltas concatenate to `tokenizer.decode(output ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(t) for t in prompt_token_ids[-_DETOKENIZE_CONTEXT_TOKENS:]]
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # every generated id
        self._held: list[int] = []  # ids DecodeStream took without emitting text yet (an unfinished character)
        self._context: list[int] = context[-1:]  # the id before the held ones (left context for `flush`)
        self.output_text = ""  # everything emitted so far

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids

    def add_one(self, token_id: int) -> str:
        """Append one generated id; return the newly complete text (possibly "")."""
        self._ids.append(token_id)
        piece = self._stream.step(self.tokenizer.backend, token_id)
        if piece is None:
            self._held.append(token_id)
            return ""
        self._context = [token_id]
        self._held.clear()
        self.output_text += piece
        return piece

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly complete text (possibly "")."""
        return "".join([self.add_one(int(t)) for t in new_ids])

    def flush(self) -> str:
        """At the end of generation: release held-back bytes (rendered as U+FFFD) so text = full decode."""
        if not self._held:
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        base = decode(self._context, skip_special_tokens=skip)
        full = decode(self._context + self._held, skip_special_tokens=skip)
        self._held = []
        piece = full[len(base):] if full.startswith(base) else full
        self.output_text += piece
        return piece


def find_stop_string(text: str, stops: Sequence[str], new_text_start: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends in the new part `text[new_text_start:]`.

    Only the new part (and the few characters before it that a stop string could straddle) is searched, so
    streaming stays linear in the output length. Returns (index where the stop string starts, the stop string);
    on a tie the longer stop wins; None if none is found."""
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        idx = text.find(stop, max(0, new_text_start - len(stop) + 1))
        if idx < 0:
            continue
        if best is None or idx < best[0] or (idx == best[0] and len(stop) > len(best[1])):
            best = (idx, stop)
    return best


def stop_holdback(stops: Sequence[str]) -> int:
    """Characters a stream must hold back before `finished` so it never shows the start of a stop string that
    a later token completes (len(longest stop) - 1)."""
    return max((len(s) for s in stops), default=1) - 1 if stops else 0
