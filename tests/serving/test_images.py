"""Images through each API (serving/images.py): read, checked, and refused while no model can see them."""

from __future__ import annotations

import base64
import io

import anthropic
import openai
import pytest
from PIL import Image

from dwarfstar.prompt.images import slot
from dwarfstar.serving.anthropic import anthropic_messages
from dwarfstar.serving.errors import ApiError
from dwarfstar.serving.fields import Fields
from dwarfstar.serving.images import Images
from dwarfstar.serving.openai_chat import openai_messages
from dwarfstar.serving.responses import input_messages
from tests.serving.test_validation import MODEL, refused


def png_base64(size: tuple[int, int] = (20, 10)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = png_base64()
CORRUPT_PNG = base64.b64encode(base64.b64decode(PNG)[:40]).decode()  # the header, the pixels cut off


def chat_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def responses_part(url: str) -> dict:
    return {"type": "input_image", "image_url": url}


def messages_part(data: str, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def request(api: str, parts: list[dict]) -> tuple[str, dict, str]:
    """The route, the body holding `parts` after a text part, and the param of the first part."""
    if api == "chat":
        content = [{"type": "text", "text": "What is this?"}, *parts]
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]}, "messages"
    if api == "responses":
        content = [{"type": "input_text", "text": "What is this?"}, *parts]
        item = {"type": "message", "role": "user", "content": content}
        return "/v1/responses", {"model": MODEL, "input": [item]}, "input"
    content = [{"type": "text", "text": "What is this?"}, *parts]
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    return "/v1/messages", body, "messages"


def part(api: str, data: str = PNG) -> dict:
    url = f"data:image/png;base64,{data}"
    return {"chat": chat_part(url), "responses": responses_part(url), "messages": messages_part(data)}[api]


APIS = ("chat", "responses", "messages")


def kind(api: str) -> str:
    return {"chat": "image_url", "responses": "input_image", "messages": "image"}[api]


def refuse(http, api: str, parts: list[dict]) -> dict:
    path, body, param = request(api, parts)
    error = refused(http, path, body)
    if api != "messages":  # Anthropic's error shape has no param
        assert error["param"].startswith(f"{param}[0].content[")
    return error


@pytest.mark.parametrize("api", APIS)
def test_each_api_reads_an_image_with_its_place(api):
    """Parsed without a server, for a model with vision: the image's bytes, and its slot in its message's
    text where the part was."""
    content = [
        {"type": "input_text" if api == "responses" else "text", "text": "Look "},
        {"type": "input_text" if api == "responses" else "text", "text": "here:"},
        part(api),
    ]
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    conversation.append({"role": "user", "content": content})
    images = Images(vision=True)
    if api == "chat":
        messages = openai_messages(conversation, images)
    elif api == "responses":
        messages = input_messages(Fields({"input": conversation}), images)
    else:
        messages = anthropic_messages(conversation, "", images)
    assert messages[-1]["content"] == "Look here:" + slot(0)
    [image] = images
    assert (image.data, image.media_type) == (base64.b64decode(PNG), "image/png")
    assert image.where == ("input" if api == "responses" else "messages") + "[2].content[2]"


def test_chat_with_an_image_says_the_model_cannot_see(oai):
    content = [{"type": "text", "text": "What is this?"}, chat_part(f"data:image/png;base64,{PNG}")]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert "no vision encoder" in str(caught.value)


def test_responses_with_an_image_says_the_model_cannot_see(oai):
    content = [{"type": "input_text", "text": "What is this?"}, responses_part(f"data:image/png;base64,{PNG}")]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=2)
    assert "no vision encoder" in str(caught.value)


def test_messages_with_an_image_says_the_model_cannot_see(claude):
    content = [{"type": "text", "text": "What is this?"}, messages_part(PNG)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}])
    assert "no vision encoder" in str(caught.value)


def test_count_tokens_with_an_image_says_the_model_cannot_see(http):
    _, body, _ = request("messages", [part("messages")])
    del body["max_tokens"]
    assert "no vision encoder" in refused(http, "/v1/messages/count_tokens", body)["message"]


@pytest.mark.parametrize("api", APIS)
def test_the_refusal_names_the_missing_flag(http, api):
    error = refuse(http, api, [part(api)] * 3)
    assert "--vision" in error["message"] and "content[1]" in error["message"]  # the first image


@pytest.mark.parametrize("api", APIS)
def test_a_seventeenth_image_is_refused(api):
    images = Images(vision=True)
    for n in range(16):
        images.read(part(api), kind(api), f"content[{n}]")
    with pytest.raises(ApiError, match="at most 16 images"):
        images.read(part(api), kind(api), "content[16]")


@pytest.mark.parametrize("api", APIS)
def test_a_streamed_request_is_refused_before_its_stream(http, api):
    path, body, _ = request(api, [part(api)])
    assert "no vision encoder" in refused(http, path, {**body, "stream": True})["message"]


@pytest.mark.parametrize("api", ("chat", "responses"))
def test_an_http_url_is_not_fetched(http, api):
    maker = chat_part if api == "chat" else responses_part
    error = refuse(http, api, [maker("https://example.com/cat.png")])
    assert "not fetched" in error["message"] and "data URL" in error["message"]


def test_an_anthropic_url_source_is_not_fetched(http):
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    assert "'url' is not supported" in refuse(http, "messages", [block])["message"]


def test_a_responses_file_id_is_refused(http):
    assert "file_id" in refuse(http, "responses", [{"type": "input_image", "file_id": "file-1"}])["message"]


@pytest.mark.parametrize("api", APIS)
def test_corrupt_base64_is_named(http, api):
    error = refuse(http, api, [part(api, "not base64!")])
    assert "content[1]" in error["message"] and "not valid base64" in error["message"]


@pytest.mark.parametrize("api", APIS)
def test_a_corrupt_png_is_named_before_the_missing_encoder(http, api):
    error = refuse(http, api, [part(api), part(api, CORRUPT_PNG)])
    assert "content[2]" in error["message"] and "not a readable image" in error["message"]


def test_an_unsupported_media_type_is_named(http):
    error = refuse(http, "messages", [messages_part(PNG, "image/tiff")])
    assert "'image/tiff' is not supported" in error["message"]


def test_a_text_only_request_is_answered(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert reply.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("path", "kind"), [("/v1/chat/completions", "invalid_request_error"), ("/v1/messages", "request_too_large")]
)
def test_a_body_over_64_mib_is_a_413_in_the_api_shape(http, path, kind):
    """ds4's limit: a request of many images may come near it; past it the answer is a 413, not a hang."""
    text = "a" * (64 * 1024 * 1024)
    response = http.post(path, json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == kind and error["message"] == "request body over 67108864 bytes"
