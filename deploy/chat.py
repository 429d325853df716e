"""Chat requests with tools and reasoning (issue 20): turning OpenAI messages into what the checkpoint's chat
template renders, and the model's output into OpenAI content, `reasoning_content` and `tool_calls`."""
from __future__ import annotations

import json
from typing import Any


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose assistant `tool_calls[*].function.arguments` JSON strings are parsed into objects (the
    template renders objects). A string that is not a JSON object raises ValueError (a 400 for the caller)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            parsed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    value = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    if not isinstance(value, dict):
                        raise ValueError("tool_calls: function.arguments must be a JSON object")
                    fn["arguments"] = value
                parsed.append({**call, "function": fn})
            m = {**m, "tool_calls": parsed}
        out.append(m)
    return out
