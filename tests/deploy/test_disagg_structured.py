"""Structured output through a disaggregated app (issue 20): one prefill and one decode replica of the built-in
tiny model (the cpu-pd layout: configs/serve/cpu-pd.yaml; tests/deploy/pdapp.py), the official `openai` client,
a json_schema response_format at temperature 1 over several seeds. The prefill replica samples the first token
under the grammar, the decode replica continues the same grammar from it: every document parses and validates,
streamed too; a reply of one token (prefill alone) is a valid start of the document; no KV page stays taken."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from tests.deploy.pdapp import handle, pages_in_use, pd_app
from tests.deploy.test_structured_e2e import MAX_TOKENS, SCHEMA, USER

SEEDS = range(8)
FORMAT = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def pd(serve_app):
    return pd_app(serve_app)


async def _chats(app, seeds, **fields) -> list:
    client = app.async_client()
    try:
        return await asyncio.gather(*(client.chat.completions.create(
            model=app.model, messages=USER, temperature=1.0, seed=s, **fields) for s in seeds))
    finally:
        await client.close()


def _validate(text: str | None) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_json_schema_through_prefill_and_decode_always_validates(pd):
    handle("Router").pop_request_stats.remote().result()  # only this test's requests below
    replies = asyncio.run(_chats(pd, SEEDS, response_format=FORMAT, max_tokens=MAX_TOKENS))
    docs = []
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        docs.append(_validate(choice.message.content))
        assert r.usage.completion_tokens > 1  # decode continued after the prefill's token
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > len(SEEDS) // 2  # sampled, not one fixed document
    pd.wait_idle()
    assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}
    # every request went prefill -> KV handoff -> decode, which ended it at the grammar's end
    by_role: dict[str, list] = {}
    for s in handle("Router").pop_request_stats.remote().result():
        by_role.setdefault(s.role, []).append(s)
    assert sorted(s.finished_reason for s in by_role["prefill"]) == ["handoff"] * len(SEEDS)
    assert sorted(s.finished_reason for s in by_role["decode"]) == ["stop"] * len(SEEDS)


def test_json_schema_streamed_through_prefill_and_decode(pd):
    client = pd.client()
    for seed in range(3):
        stream = client.chat.completions.create(model=pd.model, messages=USER, temperature=1.0, seed=seed,
                                                response_format=FORMAT, max_tokens=MAX_TOKENS, stream=True)
        text, finish = "", None
        for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert finish == "stop", (finish, text)
        _validate(text)
    pd.wait_idle()


def test_one_token_reply_is_a_valid_start(pd):
    """max_tokens=1: the prefill replica's token alone, sampled under the grammar: the document's opening brace
    (or the whitespace before it); unconstrained, the random model starts otherwise for most seeds."""
    replies = asyncio.run(_chats(pd, SEEDS, response_format=FORMAT, max_tokens=1))
    texts = [r.choices[0].message.content or "" for r in replies]
    assert all(t.lstrip() in ("", "{") or t.lstrip().startswith("{") for t in texts), texts
    assert any("{" in t for t in texts), texts
    free = asyncio.run(_chats(pd, SEEDS, max_tokens=1))
    assert sum((r.choices[0].message.content or "").lstrip().startswith("{") for r in free) < len(SEEDS) // 2
    pd.wait_idle()
