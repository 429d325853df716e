"""More prompts in one request than the engines can hold waiting (issue 22, item 7): it can never be admitted, so it
is a 400 naming `prompt` (before: a 429 on an idle server, forever); as many as they hold still run."""
from __future__ import annotations

import httpx

from tests.deploy.test_errors import assert_openai_error, still_serves


def test_more_prompts_than_the_waiting_queue_holds_is_a_400(serve_app):
    limit = serve_app.config["engine"]["max_waiting"]  # one replica in the session's app
    body = {"model": serve_app.model, "prompt": [[5, 6]] * (limit + 1), "max_tokens": 1}
    r = httpx.post(f"{serve_app.base_url}/v1/completions", json=body, headers=serve_app.headers, timeout=60)
    assert_openai_error(r, 400, param="prompt")
    assert f"at most {limit}" in r.json()["error"]["message"]
    r = httpx.post(f"{serve_app.base_url}/v1/completions", json={**body, "prompt": [[5, 6]] * 4},
                   headers=serve_app.headers, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    serve_app.wait_idle()
    still_serves(serve_app)
