"""Hostile sampling fields through real Ray Serve (issue 22): non-finite numbers, integers past int64, stop ids
outside the vocabulary. Each is a 400 in OpenAI's shape naming the field, never a 5xx, and the server still
serves afterwards (before, a NaN temperature was a 200 of pad tokens and a top_k of 2**63 killed the step thread)."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.deploy.test_errors import assert_openai_error, still_serves

VOCAB = 384  # the tiny preset


def _completion(app, **fields):
    return {"model": app.model, "prompt": "hello", "max_tokens": 4, **fields}


def _chat(app, **fields):
    return {"model": app.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


CASES = [
    ("/v1/completions", "temperature", math.nan), ("/v1/chat/completions", "temperature", math.inf),
    ("/v1/completions", "top_p", math.nan), ("/v1/completions", "repetition_penalty", math.nan),
    ("/v1/chat/completions", "presence_penalty", -math.inf), ("/v1/completions", "top_k", 2**63),
    ("/v1/chat/completions", "top_k", 9223372036854775808), ("/v1/completions", "seed", 2**64),
    ("/v1/completions", "stop_token_ids", [VOCAB + 3]), ("/v1/completions", "min_p", math.nan),
]


@pytest.mark.parametrize("path,field,value", CASES, ids=[f"{p.split('/')[-1]}-{f}={v!r}" for p, f, v in CASES])
def test_hostile_sampling_field_is_a_400_naming_it(serve_app, path, field, value):
    build = _completion if path.endswith("/completions") and "chat" not in path else _chat
    body = build(serve_app, **{field: value})
    # NaN / Infinity literals, as Python's json (and so many clients) writes them
    r = httpx.post(f"{serve_app.base_url}{path}", content=json.dumps(body), timeout=60,
                   headers={**serve_app.headers, "content-type": "application/json"})
    assert_openai_error(r, 400, param=field)
    still_serves(serve_app)


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_lone_surrogate_text_is_a_400_naming_the_field(serve_app, path, field):
    """"\\ud800" is valid JSON but no encodable text: the tokenizer raised and the server answered 500."""
    body = (_completion(serve_app, prompt="hi \ud800 there") if field == "prompt"
            else _chat(serve_app, messages=[{"role": "user", "content": "hi \ud800"}]))
    r = httpx.post(f"{serve_app.base_url}{path}", content=json.dumps(body), timeout=60,
                   headers={**serve_app.headers, "content-type": "application/json"})
    assert_openai_error(r, 400, param=field)
    still_serves(serve_app)
