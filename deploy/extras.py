"""The smaller API details OpenAI clients and vLLM users rely on (issue 20): `/tokenize` and `/detokenize` in
vLLM's request and response shapes, `/version`, unknown request fields named once in the log, and the sampling
defaults a checkpoint's `generation_config.json` sets. The routes themselves are thin methods of
`deploy.ingress.Ingress`; what they compute lives here. (`X-Request-Id` needs nothing here: Ray Serve's proxy takes a client's as the request's id
and echoes it, or sends its own, on every response; tests/deploy/test_api_extras.py holds it to that.)
"""
from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

from deploy import chat
from deploy.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

logger = logging.getLogger("m3serve.ingress")

# What vLLM takes from generation_config.json as the defaults of requests that leave them out (issue 20 names
# these three; the others vLLM reads there are not sampling behaviour clients expect to inherit).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """`temperature` / `top_p` / `top_k` from the checkpoint's generation_config.json (numbers only; a missing
    or unreadable file gives none: the server's own defaults apply)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        logger.warning("generation_config.json unreadable, no sampling defaults from it: %r", e)
        return {}
    out: dict[str, float | int] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = int(value) if key == "top_k" else float(value)
    return out


def server_version() -> str:
    try:
        return metadata.version("m3serve")
    except metadata.PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# /tokenize and /detokenize (vLLM's shapes)


def tokenize(tokenizer: Any, body: TokenizeCompletionRequest | TokenizeChatRequest,
             server_kwargs: dict[str, Any] | None, max_model_len: int) -> dict[str, Any]:
    """vLLM's `/tokenize` answer: `count`, `max_model_len`, `tokens`, `token_strs` (null unless asked).
    Raises chat.ChatRequestError for a chat the template rejects."""
    if isinstance(body, TokenizeChatRequest):
        text = chat.render_chat(tokenizer, body, server_kwargs).text
    else:
        text = body.prompt
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: Any, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's `/detokenize` answer: `{"prompt": text}`. Raises chat.ChatRequestError (param `tokens`) for an id
    outside the vocabulary."""
    bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise chat.ChatRequestError("tokens", f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


# ----------------------------------------------------------------------------------------------------------------
# Unknown request fields


class UnknownFieldLog:
    """Logs each ignored request field name once per process (clients send the same extras on every call)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger
        self._seen: set[str] = set()

    def __call__(self, names: list[str]) -> None:
        for name in names:
            if name not in self._seen:
                self._seen.add(name)
                self._logger.warning("ignoring unknown request field %r (logged once)", name)
