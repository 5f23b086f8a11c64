"""Each rule of dwarfstar/serving/validation.py through HTTP: the status, the API's error shape, and no job.

A test is named after its API and rule (`test_chat_role` checks the Chat Completions `role` rule).
Every refusal is sent with `refused`, which reads `/metrics` before and after: no request may have
been counted as accepted, and no job may be queued or running once it is answered.
"""

from __future__ import annotations

import re
import time

import pytest

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
MODEL = "deepseek-v4-flash"
HI = [{"role": "user", "content": "hi"}]
FUNCTION = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
# a 2×2 red PNG
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGM8ISfHwMDAxMDAwMDAAAANBAEIfXHKZgAAAABJRU5ErkJggg=="
IMAGE_URL = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
CTX = 4096  # conftest's BASE_CONFIG


def metrics(http) -> dict[str, float]:
    """`/metrics` summed over each name's label sets."""
    totals: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def idle(http) -> dict[str, float]:
    """The metrics once no job is queued or running (the worker updates its gauges once a loop turn)."""
    deadline = time.monotonic() + 10
    while True:
        now = metrics(http)
        busy = now["dwarfstar_active_requests"] + now["dwarfstar_queue_depth"]
        if not busy or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def refused(http, path: str, body: dict, status: int = 400, method: str = "POST") -> dict:
    """Send a request that must be refused: its error object, after checking the shape and that no job
    was accepted or left behind."""
    before = idle(http)
    response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    after = idle(http)
    assert after["dwarfstar_requests_total"] == before["dwarfstar_requests_total"]
    assert after["dwarfstar_active_requests"] == after["dwarfstar_queue_depth"] == 0
    payload = response.json()
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and set(payload["error"]) >= {"type", "message"}
        error = payload["error"]
    else:
        error = payload["error"]
        assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


def last_prompt(server) -> str:
    return server.trace_records()[-1]["prompt"]


# -- Chat Completions --------------------------------------------------------------------------------
def test_chat_empty(http):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert "messages must not be empty" in error["message"] and error["param"] == "messages"


@pytest.mark.parametrize(
    ("message", "fragment"),
    [({"role": "wizard", "content": "hi"}, "unknown role 'wizard'"), ({"content": "hi"}, "has no role")],
)
def test_chat_role(http, message, fragment):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": [message]})
    assert fragment in error["message"] and error["param"] == "messages[0].role"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "needs tools"),
        ({"tools": [FUNCTION], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'f', which is not"),
        ({"tools": [FUNCTION], "tool_choice": "sometimes"}, "tool_choice must be"),
    ],
)
def test_chat_tool_choice(http, extra, fragment):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, **extra})
    assert fragment in error["message"] and error["param"] == "tool_choice"


def test_chat_n(http):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, "n": 2})
    assert error["param"] == "n"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_context(http, field):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, field: CTX})
    assert error["code"] == "context_length_exceeded" and error["n_ctx"] == CTX
    prompt = error["n_prompt_tokens"]
    assert f"maximum context length is {CTX} tokens" in error["message"]
    assert (
        f"you requested {prompt + CTX} tokens ({prompt} in the messages, {CTX} in the completion)" in error["message"]
    )


@pytest.mark.parametrize(
    ("part", "fragment"),
    [
        (IMAGE_URL, "no vision encoder"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio' is not supported"),
        ({"type": "file", "file": {"file_id": "f"}}, "'file' is not supported"),
    ],
)
def test_chat_media(http, part, fragment):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert fragment in error["message"] and error["param"] == "messages[0].content[1]"


def test_chat_media_in_a_tool_result_is_named(http, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "A map:"}, IMAGE_URL]},
    ]
    body = {"model": MODEL, "messages": messages, "tools": [FUNCTION], "max_tokens": 2, "thinking": False}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert "<tool_result>A map:[Unsupported image_url]</tool_result>" in last_prompt(server)


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([*HI, {"role": "assistant", "content": "Hello"}], "ends with a message of role 'assistant'"),
        ([{"role": "system", "content": "Be brief."}], "holds no user message"),
    ],
)
def test_chat_answer(http, messages, fragment):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert fragment in error["message"] and "nothing for the model to answer" in error["message"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "between 0 and 20"),
        ({"top_logprobs": 3}, '"logprobs": true'),
        ({"logprobs": False, "top_logprobs": 3}, '"logprobs": true'),
        ({"logprobs": 5}, "must be a boolean"),
    ],
)
def test_chat_logprobs(http, extra, fragment):
    error = refused(http, "/v1/chat/completions", {"model": MODEL, "messages": HI, **extra})
    assert fragment in error["message"] and error["param"] in ("logprobs", "top_logprobs")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_loop_guard_field(http, path):
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, "loop_guard": "yes"}
    error = refused(http, path, body)
    assert "loop_guard must be a boolean" in error["message"]


# -- Completions --------------------------------------------------------------------------------------
def test_completions_logprobs(http):
    error = refused(http, "/v1/completions", {"prompt": "hi", "logprobs": 21})
    assert error["param"] == "logprobs" and "between 0 and 20" in error["message"]


def test_completions_n(http):
    assert refused(http, "/v1/completions", {"prompt": "hi", "n": 3})["param"] == "n"


def test_completions_context(http):
    error = refused(http, "/v1/completions", {"prompt": "hi", "max_tokens": CTX - 1})
    assert error["code"] == "context_length_exceeded" and "in the prompt" in error["message"]


# -- Responses ---------------------------------------------------------------------------------------
def test_responses_empty(http):
    error = refused(http, "/v1/responses", {"model": MODEL, "input": []})
    assert "input must not be empty" in error["message"] and error["param"] == "input"


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ({"type": "message", "role": "wizard", "content": "hi"}, "unknown role 'wizard'"),
        ({"type": "message"}, "no role"),
    ],
)
def test_responses_role(http, item, fragment):
    error = refused(http, "/v1/responses", {"model": MODEL, "input": [item]})
    assert fragment in error["message"] and error["param"] == "input[0].role"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "needs tools"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}}, "forced"),
    ],
)
def test_responses_tool_choice(http, extra, fragment):
    error = refused(http, "/v1/responses", {"model": MODEL, "input": "hi", **extra})
    assert fragment in error["message"] and error["param"] == "tool_choice"


def test_responses_context(http):
    error = refused(http, "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": CTX})
    assert error["code"] == "context_length_exceeded" and "in the input" in error["message"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [({"top_logprobs": 2}, "message.output_text.logprobs"), ({"top_logprobs": 30}, "between 0 and 20")],
)
def test_responses_logprobs(http, extra, fragment):
    asked = {"include": ["message.output_text.logprobs"]} if extra["top_logprobs"] > 20 else {}
    body = {"model": MODEL, "input": "hi", **asked, **extra}
    error = refused(http, "/v1/responses", body)
    assert error["param"] == "top_logprobs" and fragment in error["message"]


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        ({"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}, "no vision encoder"),
        ({"type": "input_file", "file_id": "f"}, "'input_file' is not supported"),
    ],
)
def test_responses_media(http, block, fragment):
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is this?"}, block]}
    error = refused(http, "/v1/responses", {"model": MODEL, "input": [item]})
    assert fragment in error["message"] and error["param"] == "input[0].content[1]"


def test_responses_answer(http):
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": "Hello"},
    ]
    error = refused(http, "/v1/responses", {"model": MODEL, "input": items})
    assert "nothing for the model to answer" in error["message"] and error["param"] == "input"


# -- Messages ----------------------------------------------------------------------------------------
def test_messages_max_tokens(http):
    error = refused(http, "/v1/messages", {"model": MODEL, "messages": HI})
    assert error["message"] == "missing max_tokens"
    counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": HI})  # takes none
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_messages_empty(http):
    error = refused(http, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": []})
    assert "messages must not be empty" in error["message"]


def test_messages_role(http):
    error = refused(http, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot"}]})
    assert 'role "user", "assistant" or "system"' in error["message"]


def test_messages_merge(http, server):
    messages = [
        {"role": "user", "content": "first [[script:hello]]"},
        {"role": "user", "content": [{"type": "text", "text": "second"}]},
    ]
    body = {"model": MODEL, "max_tokens": 40, "messages": messages, "thinking": {"type": "disabled"}}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == "Hello there, how can I help?"
    assert last_prompt(server) == f"{BOS}{USER}first [[script:hello]]\n\nsecond{ASSISTANT}</think>"
    messages = [*HI, {"role": "assistant", "content": "one"}, {"role": "assistant", "content": "two"}, *HI]
    body = {"model": MODEL, "max_tokens": 1, "messages": messages, "thinking": {"type": "disabled"}}
    assert http.post("/v1/messages", json=body).status_code == 200
    assert f"{ASSISTANT}</think>one\n\ntwo{EOS}{USER}hi" in last_prompt(server)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "f"}}, "'f', which is not"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "missing tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type must be"),
    ],
)
def test_messages_tool_choice(http, extra, fragment):
    error = refused(http, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": HI, **extra})
    assert fragment in error["message"]


def test_messages_context(http):
    error = refused(http, "/v1/messages", {"model": MODEL, "max_tokens": CTX, "messages": HI})
    found = re.fullmatch(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), "
        r"decrease input length or `max_tokens` and try again",
        error["message"],
    )
    assert found and (int(found[1]), int(found[2]), int(found[3])) == (error["n_prompt_tokens"], CTX, CTX)


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        (IMAGE_BLOCK, "no vision encoder"),
        ({"type": "document", "source": {"type": "text", "data": "x"}}, "'document' is not supported"),
    ],
)
def test_messages_media(http, block, fragment):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}]
    error = refused(http, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": messages})
    assert fragment in error["message"]


def test_messages_media_in_a_tool_result_is_named(http, server):
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "A map:"}, IMAGE_BLOCK],
    }
    messages = [*HI, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    body = {"model": MODEL, "max_tokens": 2, "messages": messages, "tools": [TOOL]}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert "<tool_result>A map:[Unsupported image]</tool_result>" in last_prompt(server)


def test_messages_answer(http):
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    error = refused(http, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": messages})
    assert error["message"] == (
        "This model does not support assistant message prefill. The conversation must end with a user message."
    )


# -- every route ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_method_405(http, path):
    error = refused(http, path, {}, status=405, method="GET")
    assert error["message"] == f"Invalid method for URL (GET {path})"
    assert http.get(path).headers["allow"] == "POST"
