"""Issue 22's table-driven hostile-input suite through real Ray Serve: every body below is refused with a 4xx in
OpenAI's error shape (never a 5xx, never a hang), and afterwards the engines hold no running or waiting request
and every KV page is free, and the server still serves. Types, bounds, NaN / Infinity, huge integers, empty and
nested prompts, out-of-vocabulary and negative ids, wrong content types and bodies, every chat role misused.
(Field-by-field naming of the bad parameter is checked in test_errors.py / test_bad_input.py; here the point is
the whole table against one server, then its state.) Lenient on purpose, as vLLM is: a tool message without
`tool_call_id`, a null content, `"stream": "yes"` (pydantic's lax bool) are accepted, not refused."""
from __future__ import annotations

import json
import math

import httpx

from tests.deploy.test_errors import still_serves

VOCAB = 384  # the tiny preset
C, CH = "/v1/completions", "/v1/chat/completions"


def _c(**f):
    return {"prompt": "hello", "max_tokens": 4, **f}


def _ch(**f):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **f}


# (name, path, body: dict (sent as JSON with NaN/Infinity literals) or bytes, content type, expected status)
TABLE = [
    ("max_tokens huge", C, _c(max_tokens=2**70), None, 400),
    ("max_tokens negative", C, _c(max_tokens=-5), None, 400),
    ("max_tokens float", C, _c(max_tokens=3.5), None, 400),
    ("n huge", C, _c(n=10**9), None, 400),
    ("n NaN", C, _c(n=math.nan), None, 400),
    ("temperature string", CH, _ch(temperature="hot"), None, 400),
    ("top_p Infinity", CH, _ch(top_p=math.inf), None, 400),
    ("frequency_penalty huge", C, _c(frequency_penalty=1e300), None, 400),
    ("logprobs negative", C, _c(logprobs=-1), None, 400),
    ("top_logprobs huge", CH, _ch(logprobs=True, top_logprobs=10**6), None, 400),
    ("seed negative huge", C, _c(seed=-(2**70)), None, 400),
    ("stop not strings", C, _c(stop=[1, 2]), None, 400),
    ("stop_token_ids negative", C, _c(stop_token_ids=[-3]), None, 400),
    ("prompt empty string list", C, _c(prompt=[]), None, 400),
    ("prompt nested three deep", C, _c(prompt=[[[1, 2]]]), None, 400),
    ("prompt batch with an empty one", C, _c(prompt=[[1, 2], []]), None, 400),
    ("prompt negative id", C, _c(prompt=[1, -2]), None, 400),
    ("prompt id past the vocabulary", C, _c(prompt=[1, VOCAB]), None, 400),
    ("prompt id past int64", C, _c(prompt=[1, 2**64]), None, 400),
    ("prompt an object", C, _c(prompt={"text": "hi"}), None, 400),
    ("prompt null", C, _c(prompt=None), None, 400),
    ("messages not a list", CH, _ch(messages="hi"), None, 400),
    ("message without role", CH, _ch(messages=[{"content": "hi"}]), None, 400),
    ("system content a number", CH, _ch(messages=[{"role": "system", "content": 5}, {"role": "user", "content": "x"}]),
     None, 400),
    ("user content parts of an unknown type", CH,
     _ch(messages=[{"role": "user", "content": [{"type": "video", "video": "x"}]}]), None, 400),
    ("assistant tool_calls not a list", CH,
     _ch(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "f()"}]), None, 400),
    ("stream a list", C, _c(stream=[True]), None, 400),
    ("tool message content an object", CH,
     _ch(messages=[{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": {"a": 1}}]),
     None, 400),
    ("stream_options without stream", C, _c(stream_options={"include_usage": True}), None, 400),
    ("body a JSON list", C, b"[1, 2, 3]", "application/json", 400),
    ("body not JSON", C, b"{prompt: hello", "application/json", 400),
    ("body empty", CH, b"", "application/json", 400),
    ("body invalid UTF-8", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', "application/json", 400),
    ("form-encoded body", C, b"prompt=hello&max_tokens=4", "application/x-www-form-urlencoded", 400),
    ("plain-text body", CH, b"hello", "text/plain", 400),
]


def _send(app, path, body, content_type) -> httpx.Response:
    if isinstance(body, dict):
        body = json.dumps({"model": app.model, **body}).encode()
        content_type = "application/json"
    headers = {**app.headers, "content-type": content_type}
    return httpx.post(f"{app.base_url}{path}", content=body, headers=headers, timeout=60)


def test_hostile_table_is_all_4xx_and_leaves_nothing_behind(serve_app):
    wrong = []
    for name, path, body, ctype, status in TABLE:
        r = _send(serve_app, path, body, ctype)
        try:
            err = r.json()["error"]
            shaped = set(err) == {"message", "type", "param", "code"} and err["message"]
        except (ValueError, KeyError, TypeError):
            shaped = False
        if r.status_code != status or not shaped:
            wrong.append(f"{name}: {r.status_code} {r.text[:200]}")
    assert not wrong, "\n".join(wrong)
    rows = serve_app.wait_idle(timeout=30)
    for row in rows:
        assert row["stats"]["num_pages_free"] == row["stats"]["num_pages_total"], row
    still_serves(serve_app)
