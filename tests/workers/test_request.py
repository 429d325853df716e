"""workers/request.py: SamplingParams refuses every value that could reach a step unchecked, naming the field."""
from __future__ import annotations

import math

import pytest

from workers.request import SamplingParams

BAD = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5), ("temperature", "1"),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("min_p", math.nan), ("min_p", -math.inf),
    ("presence_penalty", math.nan), ("frequency_penalty", math.inf), ("frequency_penalty", 2.5),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e3),
    ("top_k", 2**63), ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("n", 0), ("n", 2**64), ("max_tokens", 0), ("max_tokens", 2**70), ("min_tokens", -1),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", "7"),
    ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 2**80),
    ("stop", ("",)), ("stop", (3,)), ("stop_token_ids", (-1,)), ("stop_token_ids", (2**63,)),
    ("stop_token_ids", (True,)),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})


def test_bounds_themselves_are_accepted():
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=2**63 - 1, min_p=1.0, presence_penalty=-2.0,
                       frequency_penalty=2.0, repetition_penalty=100.0, seed=-(2**63), n=3, max_tokens=2**31,
                       min_tokens=2**31, logprobs=20, prompt_logprobs=0, stop_token_ids=(0, 2**63 - 1))
    assert p.greedy and p.top_k == 2**63 - 1
    assert SamplingParams(temperature=2, top_p=1).temperature == 2  # ints are fine where floats are asked
