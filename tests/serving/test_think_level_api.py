"""`think_level`, the request field of a V4.1 think level, through HTTP on every API: a value outside
0..100 or not an integer is a 400 naming the field, and so is any value on this V4 (preview) model.
The V4.1 prompts a request gets are checked in tests/test_think_levels.py."""

from __future__ import annotations

import pytest

from tests.serving.test_validation import HI, MODEL, refused

ENDPOINTS = [
    ("/v1/chat/completions", {"model": MODEL, "messages": HI}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": HI}),
    ("/v1/responses", {"model": MODEL, "input": "hi"}),
]


@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=[path for path, _ in ENDPOINTS])
@pytest.mark.parametrize("level", [101, -1, "high", True, 2.5])
def test_a_bad_think_level_is_a_400_naming_the_field(http, path, body, level):
    error = refused(http, path, {**body, "think_level": level})
    assert "think_level" in error["message"]
    if "param" in error:
        assert error["param"] == "think_level"


@pytest.mark.parametrize(("path", "body"), ENDPOINTS, ids=[path for path, _ in ENDPOINTS])
@pytest.mark.parametrize("level", [0, 50, 100])
def test_a_think_level_on_a_v4_model_is_a_400_naming_its_release(http, path, body, level):
    error = refused(http, path, {**body, "think_level": level})
    assert error["message"] == (
        "think_level needs a DeepSeek V4.1 model; this model is DeepSeek V4 preview (release 'preview')"
    )


def test_a_bad_reasoning_effort_is_still_a_400(http):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, "reasoning_effort": 75})
    assert "reasoning_effort" in error["message"]
