"""Images through the server with a vision encoder (`serve --vision`): each API's image becomes its
block in the prompt, the same image in the three APIs gives the same ids, a turn that repeats an
image reuses the KV through its block and runs the encoder once, another image at the same place is
never taken for it, the disk KV cache finds an image prompt after a restart, and bad images are 400s."""

from __future__ import annotations

import base64
import io
from dataclasses import replace

import httpx2 as httpx
import numpy as np
import pytest
from live_server import start_server
from PIL import Image

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.prompt.images import SLOT_OPEN
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.metrics import Metric

MODEL = "deepseek-v4-flash"
CONFIG = ServerConfig(ctx=4096, max_sessions=2, max_queue=8, prefill_chunk=256)


def png(seed: int, size=(300, 200)) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


RED, BLUE = png(1), png(2)


@pytest.fixture(scope="module")
def engine(tiny_model_file, tiny_vision_file):
    return load_engine(EngineSpec(tiny_model_file(0), "reference", ctx=4096, vision=tiny_vision_file))


@pytest.fixture
def server(engine, tmp_path):
    yield from start_server(engine, replace(CONFIG, trace=tmp_path / "trace.jsonl"))


def body(api: str, text: str, image: str, *, history: list[dict] | None = None) -> tuple[str, dict]:
    """The route and a request whose last user message is `text` then the PNG `image` (base64)."""
    url = f"data:image/png;base64,{image}"
    history = history or []
    if api == "chat":
        content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
        messages = [*history, {"role": "user", "content": content}]
        return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
    if api == "responses":
        content = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": url}]
        items = [*history, {"type": "message", "role": "user", "content": content}]
        return "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 3, "temperature": 0}
    source = {"type": "base64", "media_type": "image/png", "data": image}
    content = [{"type": "text", "text": text}, {"type": "image", "source": source}]
    messages = [*history, {"role": "user", "content": content}]
    return "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}


def usage(api: str, reply: dict) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of a reply."""
    if api == "chat":
        u = reply["usage"]
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if api == "responses":
        u = reply["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    u = reply["usage"]
    return u["cache_read_input_tokens"] + u["cache_creation_input_tokens"], u["cache_read_input_tokens"]


def post(server, path: str, payload: dict) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        return client.post(path, json=payload)


def blocks(tokens: list[int], vocab: int) -> list[tuple[int, int]]:
    """The runs of image ids in `tokens`: (first position, end)."""
    runs, start = [], None
    for i, t in enumerate([*tokens, 0]):
        if t >= vocab and start is None:
            start = i
        elif t < vocab and start is not None:
            runs.append((start, i))
            start = None
    return runs


def session_tokens(server) -> list[list[int]]:
    return [list(live.session.tokens) for live in server.service.pool.live]


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_each_api_puts_the_image_block_in_the_prompt(server, engine, api):
    path, payload = body(api, "What is this?", RED)
    reply = post(server, path, payload)
    assert reply.status_code == 200, reply.text
    prompt, _ = usage(api, reply.json())
    [tokens] = session_tokens(server)
    [(start, end)] = blocks(tokens, engine.tokenizer.vocab_size)
    assert end < prompt  # the block sits in the prompt, before the assistant's opener
    assert end - start > 4  # START, the image rows, NEWLINEs, END (Vision-Exp: maybe leading PADs)
    assert server.trace_records()[-1]["image_blocks"] == [[start, end - start]]  # what `nox -s clients` reads
    # the slot's characters never reach the model as text
    assert SLOT_OPEN not in engine.tokenizer.decode([t for t in tokens if t < engine.tokenizer.vocab_size])


def test_the_three_apis_give_the_same_prompt_ids(server):
    """The same user message with the same image: the second and third APIs reuse the first's KV up to
    the prompt's last token, so their ids are the first's."""
    prompts = []
    for api in ("chat", "responses", "messages"):
        path, payload = body(api, "Describe the picture.", RED)
        reply = post(server, path, payload)
        assert reply.status_code == 200, reply.text
        prompts.append(usage(api, reply.json()))
    (first, _), *later = prompts
    for prompt, cached in later:
        assert prompt == first and cached >= first - 1


def test_a_turn_that_repeats_the_image_reuses_its_block_and_encodes_it_once(server, engine):
    metrics = server.service.metrics
    first_image, second_image = png(3), png(4)  # images no other test sent: the encoder's cache has neither
    path, payload = body("chat", "What is this?", first_image)
    first = post(server, path, payload).json()
    answer = first["choices"][0]["message"]["content"] or "."
    history = [payload["messages"][0], {"role": "assistant", "content": answer}]
    path, payload = body("chat", "And now?", second_image, history=history)
    second = post(server, path, payload).json()
    prompt, cached = usage("chat", second)
    [tokens] = session_tokens(server)
    (_, red_end), (blue_start, _) = blocks(tokens, engine.tokenizer.vocab_size)
    assert red_end <= cached <= blue_start < prompt  # the first image's KV reused, the second's computed
    assert metrics.value(Metric.IMAGES_TOTAL.key) == 3 and metrics.value(Metric.IMAGES_ENCODED_TOTAL.key) == 2


def test_another_image_at_the_same_place_is_not_reused(server, engine):
    path, payload = body("chat", "What is this?", RED)
    post(server, path, payload)
    path, payload = body("chat", "What is this?", BLUE)
    prompt, cached = usage("chat", post(server, path, payload).json())
    tokens = max(session_tokens(server), key=lambda t: t[-1] if t else 0)
    starts = [start for start, _ in blocks(tokens, engine.tokenizer.vocab_size)]
    assert cached <= min(starts)


def test_count_tokens_counts_the_block(server):
    path, payload = body("messages", "What is this?", RED)
    del payload["max_tokens"]
    counted = post(server, "/v1/messages/count_tokens", payload).json()["input_tokens"]
    text_only = {**payload, "messages": [{"role": "user", "content": "What is this?"}]}
    plain = post(server, "/v1/messages/count_tokens", text_only).json()["input_tokens"]
    prompt, _ = usage("messages", post(server, path, {**payload, "max_tokens": 2}).json())
    assert counted == prompt and counted > plain + 4


def test_an_image_in_a_tool_result_is_seen(server, engine):
    source = {"type": "base64", "media_type": "image/png", "data": RED}
    messages = [
        {"role": "user", "content": "Open the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": source}]}
            ],
        },
    ]
    tools = [{"name": "read", "input_schema": {"type": "object", "properties": {}}}]
    reply = post(server, "/v1/messages", {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    [tokens] = session_tokens(server)
    assert len(blocks(tokens, engine.tokenizer.vocab_size)) == 1


def test_a_turn_with_an_image_and_a_tool_result_image_places_both(server, engine):
    """Anthropic renders a turn's tool results before its text, so its images are placed out of the
    order they were read in: both blocks are in the prompt."""
    source = {"type": "base64", "media_type": "image/png", "data": RED}
    other = {"type": "base64", "media_type": "image/png", "data": BLUE}
    messages = [
        {"role": "user", "content": "Open the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "image", "source": other},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": source}]},
                {"type": "text", "text": "Compare them."},
            ],
        },
    ]
    tools = [{"name": "read", "input_schema": {"type": "object", "properties": {}}}]
    reply = post(server, "/v1/messages", {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    [tokens] = session_tokens(server)
    assert len(blocks(tokens, engine.tokenizer.vocab_size)) == 2


@pytest.mark.parametrize(
    ("image", "said"),
    [
        (base64.b64encode(base64.b64decode(RED)[:60]).decode(), "content[1]"),  # cut off: corrupt
        ("not base64!", "not valid base64"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(server, image, said):
    path, payload = body("messages", "What is this?", image)
    reply = post(server, path, payload)
    assert reply.status_code == 400 and said in reply.text


def test_a_seventeenth_image_is_refused(server):
    path, payload = body("chat", "Compare.", RED)
    payload["messages"][0]["content"] += [payload["messages"][0]["content"][1]] * 16
    reply = post(server, path, payload)
    assert reply.status_code == 400 and "at most 16 images" in reply.json()["error"]["message"]


def test_text_that_forges_an_image_slot_is_refused(server):
    path, payload = body("chat", f"{SLOT_OPEN}0\ue001 twice?", RED)
    reply = post(server, path, payload)
    assert reply.status_code == 400 and "images" in reply.json()["error"]["message"]


def test_the_disk_cache_finds_an_image_prompt_after_a_restart(engine, tmp_path):
    config = replace(CONFIG, kv_disk_dir=tmp_path / "kv", kv_cache_min_tokens=16)
    path, payload = body("chat", "What is this? " * 20, RED)
    for live in start_server(engine, config):
        first = post(live, path, payload)
        assert first.status_code == 200 and usage("chat", first.json())[1] == 0
        [(start, _)] = blocks(session_tokens(live)[0], engine.tokenizer.vocab_size)
    for live in start_server(engine, config):  # a new server: nothing in memory, the shutdown save on disk
        prompt, cached = usage("chat", post(live, path, payload).json())
        assert cached >= prompt - 1
        # another image after the same text: neither the live session nor the file reaches past its start
        other = post(live, *body("chat", "What is this? " * 20, BLUE))
        assert other.status_code == 200 and usage("chat", other.json())[1] <= start


@pytest.fixture(scope="module")
def pictures():
    """A local HTTP server: /red.png (RED's bytes), /text (not an image), anything else 404."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the standard library's name)
            body = {"/red.png": base64.b64decode(RED), "/text": b"hello, not an image"}.get(self.path)
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture
def fetching(engine):
    yield from start_server(engine, replace(CONFIG, allow_image_urls=True))


def url_body(api: str, url: str) -> tuple[str, dict]:
    path, payload = body(api, "What is this?", RED)
    if api == "chat":
        payload["messages"][0]["content"][1] = {"type": "image_url", "image_url": {"url": url}}
    else:
        payload["messages"][0]["content"][1] = {"type": "image", "source": {"type": "url", "url": url}}
    return path, payload


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_an_image_url_is_fetched_with_allow_image_urls(fetching, pictures, api):
    """The fetched image is the same image as the inline one: the same ids, so the KV is reused."""
    path, payload = body(api, "What is this?", RED)
    inline, _ = usage(api, post(fetching, path, payload).json())
    reply = post(fetching, *url_body(api, pictures + "/red.png"))
    assert reply.status_code == 200, reply.text
    prompt, cached = usage(api, reply.json())
    assert prompt == inline and cached >= prompt - 1


@pytest.mark.parametrize(
    ("tail", "said"),
    [("/missing.png", "answered HTTP 404"), ("/text", "is not a PNG, JPEG, WebP or GIF")],
)
def test_a_url_that_gives_no_image_is_a_400(fetching, pictures, tail, said):
    reply = post(fetching, *url_body("chat", pictures + tail))
    assert reply.status_code == 400 and said in reply.json()["error"]["message"]
    assert "messages[0].content[1]" in reply.json()["error"]["message"]


def test_an_unreachable_url_is_a_400(fetching):
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    reply = post(fetching, *url_body("chat", f"http://127.0.0.1:{port}/red.png"))
    assert reply.status_code == 400 and "cannot fetch" in reply.json()["error"]["message"]


def test_fetched_bytes_past_the_body_limit_are_refused(fetching, pictures, monkeypatch):
    monkeypatch.setattr("dwarfstar.serving.images.MAX_BODY_BYTES", 100)
    reply = post(fetching, *url_body("chat", pictures + "/red.png"))
    assert reply.status_code == 400 and "images fetched for this request pass" in reply.json()["error"]["message"]


def test_without_the_flag_an_image_url_names_it(server, pictures):
    reply = post(server, *url_body("chat", pictures + "/red.png"))
    assert reply.status_code == 400 and "--allow-image-urls" in reply.json()["error"]["message"]
