"""Bad requests get the right status in their API's error shape; engine failures end streams cleanly.

Every request here is a client mistake (4xx) except the scripted engine failures; the last test checks
that the server still answers normally after all of them.
"""

from __future__ import annotations

import anthropic
import httpx2 as httpx
import openai
import pytest
from conftest import API_KEY

LONG = "word " * 5000  # over the 4096-token context
USER = [{"role": "user", "content": "hi"}]


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "type" in error
    return error


def anthropic_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and isinstance(body["error"]["message"], str)
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/chat/completions", b'{"model": "deepseek-v4-flash", "messages": [', "invalid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages must be an array"),
        ("/v1/chat/completions", {"model": 7, "messages": USER}, "model must be a string"),
        ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, "temperature must be a number"),
        ("/v1/chat/completions", {"messages": USER, "stream": "yes"}, "stream must be a boolean"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": -1}, "max_tokens must be between"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 10**12}, "max_tokens must be between"),
        ("/v1/chat/completions", {"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content must be"),
        ("/v1/chat/completions", {"model": "deepseek-v4-flash"}, "missing messages"),
        ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "parameters must be an object",
        ),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt must be"),
        ("/v1/completions", {"prompt": [1, 2, 3]}, '"raw": true'),
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "replay full input"),
        (
            "/v1/responses",
            {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required"},
            "tool_choice=required not supported",
        ),
        ("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "x"}]}]}, "'x'"),
    ],
)
def test_bad_openai_requests_get_400(http, path, body, fragment):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    error = openai_error(http.post(path, **kwargs), 400)
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"max_tokens": 5, "messages": USER, "tools": [{"description": "no name"}]}, "tools[0]"),
        ({"max_tokens": 5, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking"),
        ({"max_tokens": "five", "messages": USER}, "max_tokens must be an integer"),
    ],
)
def test_bad_anthropic_requests_get_400(http, body, fragment):
    error = anthropic_error(http.post("/v1/messages", json=body), 400)
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_on_messages_is_anthropic_shaped(http):
    assert anthropic_error(http.post("/v1/messages", content=b"{"), 400)["type"] == "invalid_request_error"


def test_unknown_model_and_route_get_404(oai, http):
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gpt-5", messages=USER)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-5")
    assert openai_error(http.get("/v1/nothing/here"), 404)["message"] == "unknown endpoint"
    assert anthropic_error(http.get("/v1/nothing", headers={"anthropic-version": "2023-06-01"}), 404)


def test_over_context_is_a_clear_400(oai, claude):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="deepseek-v4-flash", messages=[{"role": "user", "content": LONG}])
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["n_ctx"] == 4096 and body["n_prompt_tokens"] > 4096
    assert "configured context size is 4096 tokens" in body["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="deepseek-v4-flash", max_tokens=5, messages=[{"role": "user", "content": LONG}])
    assert err.value.body["error"]["n_ctx"] == 4096


def test_api_key_is_required(server, http):
    missing = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": USER})
    assert openai_error(missing, 401)["message"] == "missing API key"
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(model="deepseek-v4-flash", messages=USER)
    assert err.value.body["code"] == "invalid_api_key"
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        claude.messages.create(model="deepseek-v4-flash", max_tokens=5, messages=USER)
    assert err.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"  # open without a key
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    assert http.get("/metrics").status_code == 200


def test_engine_failure_ends_streams_with_an_error_event(oai, claude, http):
    failing = [{"role": "user", "content": "[[fail]]"}]
    with pytest.raises(openai.APIError, match="scripted engine failure"):
        list(oai.chat.completions.create(model="deepseek-v4-flash", messages=failing, stream=True, max_tokens=50))
    with pytest.raises(openai.InternalServerError):
        oai.chat.completions.create(model="deepseek-v4-flash", messages=failing, max_tokens=50)
    with pytest.raises(anthropic.APIStatusError, match="scripted engine failure"):
        list(claude.messages.create(model="deepseek-v4-flash", max_tokens=50, messages=failing, stream=True))
    events = list(oai.responses.create(model="deepseek-v4-flash", input="[[fail]]", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed"


def test_server_still_answers_normally(oai, server):
    reply = oai.chat.completions.create(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "[[script:hello]]"}],
        extra_body={"think": False},
    )
    assert reply.choices[0].message.content == "Hello there, how can I help?"
    assert openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY).models.list().data
