"""Shared by the in-process disaggregation tests: drive a prefill and a decode engine the way their servers'
step threads and the router do."""
from __future__ import annotations

import time


def drive_pair(prefill, decode, until, *, timeout: float = 30.0, on_first=None) -> dict:
    """Step both engines until `until(state)`, handing each first token from prefill to decode (the router's
    part; `on_first(output)` False: keep it back). Returns the state: final decode outputs ("out"), prefill
    outputs ("first"), the prefill's transfer outcomes ("outcomes") and the decode's failures ("failures")."""
    state = {"out": {}, "first": {}, "outcomes": {}, "failures": {}}
    deadline = time.monotonic() + timeout
    while not until(state):
        if time.monotonic() > deadline:
            raise AssertionError(f"stuck: {state['outcomes']} {state['failures']}")
        busy = False
        if prefill.has_unfinished():
            for o in prefill.step():
                busy = True
                if o.finished:
                    state["first"][o.request_id] = o
                    c = o.outputs[0]
                    if c.finish_reason is None and (on_first is None or on_first(o)):  # handed off
                        decode.continue_remote(o.request_id, c.token_ids[0], c.logprobs[0] if c.logprobs else None)
            state["outcomes"].update({rid: (ok, why) for rid, ok, why in prefill.pop_transfer_outcomes()})
        if decode.has_unfinished():
            for o in decode.step():
                busy = True
                if o.finished:
                    state["out"][o.request_id] = o
            state["failures"].update(dict(decode.pop_failures()))
        if not busy:
            time.sleep(0.002)
    return state
