"""Logprobs through the real HTTP stack (serving/logprobs.py) on the tiny random model, greedy.

The expected numbers come from an independent run of the reference backend's session and
torch.log_softmax in float64, and from `dwarfstar run --dump-logprobs` on the same model file.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.session.session import Session

_register_commands()
PROMPT = [0, 1043, 2511, 733, 980, 77]  # raw token ids: no template, so run and the API see the same
N, TOP = 5, 3
GREEDY_RAW = {"prompt": PROMPT, "raw": True, "temperature": 0, "max_tokens": N}
CHAT = {"messages": [{"role": "user", "content": "Tell me about Milan"}], "temperature": 0, "max_tokens": N}
CHAT |= {"thinking": False, "logprobs": True, "top_logprobs": TOP}


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def check_entry(entry: dict) -> None:
    """One chat-shaped entry: greedy picks the best alternative; the alternatives' mass is at most 1."""
    top = entry["top_logprobs"]
    assert len(top) == TOP and top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
    assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-6
    assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]


@pytest.fixture(scope="module")
def raw(http) -> dict:
    response = http.post("/v1/completions", json={**GREEDY_RAW, "logprobs": TOP})
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_logprobs_are_the_reference_log_softmax(raw, engine):
    block = raw["choices"][0]["logprobs"]
    session = Session(engine.backend.inner, ctx=4096)  # the server's model, outside the server
    logits = session.prefill(PROMPT)
    tokenizer = engine.tokenizer
    assert len(block["tokens"]) == raw["usage"]["completion_tokens"] == N
    for token, logprob, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"], strict=True):
        want = torch.log_softmax(logits.double().flatten(), dim=-1)
        chosen = int(want.argmax())  # greedy is the argmax
        assert token == tokenizer.token_bytes(chosen).decode("utf-8", errors="replace")
        assert logprob == pytest.approx(float(want[chosen]), abs=1e-4)
        best = want.topk(TOP)
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
        logits = session.decode(chosen)
    assert block["text_offset"][0] == 0


def test_completions_streamed_equal_unstreamed(raw, http):
    response = http.post("/v1/completions", json={**GREEDY_RAW, "logprobs": TOP, "stream": True})
    blocks = [c["choices"][0]["logprobs"] for c in sse_events(response) if c["choices"]]
    blocks = [b for b in blocks if b]
    merged = {key: sum((b[key] for b in blocks), []) for key in ("tokens", "token_logprobs", "top_logprobs")}
    want = raw["choices"][0]["logprobs"]
    assert merged == {key: want[key] for key in merged}
    assert sum((b["text_offset"] for b in blocks), []) == want["text_offset"]


def test_run_dump_logprobs_equals_the_api(raw, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_synthetic_model(model, TINY, seed=0)  # the server's model (conftest writes it the same way)
    out = tmp_path / "logprobs.json"
    args = ["-m", str(model), "--backend", "reference", "--ctx", "4096", "-n", str(N), "--temp", "0"]
    args += ["--prompt-tokens", ",".join(map(str, PROMPT)), "--dump-logprobs", str(out), "--logprobs-top-k", str(TOP)]
    done = CliRunner().invoke(app, ["run", *args])
    assert done.exit_code == 0, done.output
    steps = json.loads(out.read_text(encoding="utf-8"))["steps"]
    block = raw["choices"][0]["logprobs"]
    assert [s["logprob"] for s in steps] == block["token_logprobs"]
    alternatives = [[t["logprob"] for t in s["top_logprobs"]] for s in steps]
    assert alternatives == [list(t.values()) for t in block["top_logprobs"]]


def test_chat_logprobs_streamed_equal_unstreamed(http):
    done = http.post("/v1/chat/completions", json=CHAT).json()
    content = done["choices"][0]["logprobs"]["content"]
    finish = done["choices"][0]["finish_reason"]
    assert content and len(content) == done["usage"]["completion_tokens"] - (finish == "stop")  # EOS: no entry
    for entry in content:
        check_entry(entry)
    response = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    streamed = [c["choices"][0]["logprobs"] for c in sse_events(response) if c["choices"]]
    assert sum((s["content"] for s in streamed if s), []) == content


def test_chat_without_logprobs_has_none(http):
    body = {key: value for key, value in CHAT.items() if key not in ("logprobs", "top_logprobs")}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"] is None


def test_responses_include_logprobs(http):
    body = {"input": "Tell me about Milan", "temperature": 0, "max_output_tokens": N, "reasoning": {"effort": "none"}}
    body |= {"include": ["message.output_text.logprobs"], "top_logprobs": TOP}
    done = http.post("/v1/responses", json=body).json()
    entries = next(item for item in done["output"] if item["type"] == "message")["content"][0]["logprobs"]
    assert entries
    for entry in entries:
        check_entry(entry)
    response = http.post("/v1/responses", json={**body, "stream": True})
    deltas = [e for e in sse_events(response) if e["type"] == "response.output_text.delta"]
    assert sum((d["logprobs"] for d in deltas), []) == entries[: sum(len(d["logprobs"]) for d in deltas)]
