"""`serve --mtp`: speculation inside the server's batched decode, on the bundled model with its trained
MTP block. Greedy replies are the text the server gives without it, each reply's usage counts its
accepted and rejected drafts, and /metrics adds them up."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.testclient import TestClient

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.serving.app import create_app
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.service import Service
from dwarfstar.speculative.mtp_options import MTPOptions

PROMPTS = ["Quel ramo del lago di Como", "Renzo e Lucia", "Don Abbondio tornava bel bello"]
MODEL = "deepseek-v4-flash"  # the name the server gives the bundled model
MAX_TOKENS = [48, 31, 7]  # 7 and 31: a request can end inside a step's accepted drafts


@pytest.fixture(scope="module")
def engine():
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=512))


def replies(engine, mtp: MTPOptions | None, concurrent: bool) -> tuple[list[dict], str]:
    """The completions of PROMPTS (greedy), and the server's /metrics afterwards."""
    config = ServerConfig(ctx=512, max_sessions=len(PROMPTS), prefill_chunk=64, mtp=mtp)
    with TestClient(create_app(Service(engine, config))) as client:

        def ask(i: int) -> dict:
            body = {"model": MODEL, "prompt": PROMPTS[i], "raw": True, "max_tokens": MAX_TOKENS[i], "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        if concurrent:
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                out = list(pool.map(ask, range(len(PROMPTS))))
        else:
            out = [ask(i) for i in range(len(PROMPTS))]
        return out, client.get("/metrics").text


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def plain(engine):
    return replies(engine, None, concurrent=False)[0]


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-by-one", "together"])
def test_greedy_replies_equal_the_server_without_mtp(engine, plain, concurrent):
    got, metrics = replies(engine, MTPOptions(None, 3), concurrent)
    drafted = accepted = 0
    for reply, want, max_tokens in zip(got, plain, MAX_TOKENS, strict=True):
        assert reply["choices"][0]["text"] == want["choices"][0]["text"]
        assert reply["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == max_tokens
        details = reply["usage"]["completion_tokens_details"]
        accepted += details["accepted_prediction_tokens"]
        drafted += details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
        assert want["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    assert 0 < accepted < drafted  # the trained block is right often, not always
    assert metric(metrics, "dwarfstar_draft_tokens_total") == drafted
    assert metric(metrics, "dwarfstar_accepted_draft_tokens_total") == accepted
    assert metric(metrics, "dwarfstar_generated_tokens_total") == sum(MAX_TOKENS)
    # a step emits its accepted drafts and one more token: fewer steps than tokens
    assert metric(metrics, "dwarfstar_speculative_steps_total") < sum(MAX_TOKENS) - len(PROMPTS)


def test_a_request_with_an_image_is_speculated_with_the_same_reply(seeing):
    """The prompt's image block is in the KV before drafting starts: greedy MTP replies equal plain ones."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "Renzo e Lucia"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0}
    answers = []
    for mtp in (None, MTPOptions(None, 2)):
        config = ServerConfig(ctx=512, max_sessions=1, prefill_chunk=64, mtp=mtp, think_by_default=False)
        with TestClient(create_app(Service(seeing, config))) as client:
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())
    plain, speculated = answers
    assert speculated["choices"][0]["message"] == plain["choices"][0]["message"]
    details = speculated["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0
