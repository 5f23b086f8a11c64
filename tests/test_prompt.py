"""The renderer against the official DeepSeek V4 encoder's renderings and the official API's token counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from dwarfstar.prompt import PromptError, render_conversation
from dwarfstar.tokenizer import Control, Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CORPUS = json.loads((Path(__file__).parent / "data" / "encoding" / "corpus.json").read_text(encoding="utf-8"))
CASES = CORPUS["cases"]
SPECIAL_STRINGS = ("<｜", "｜>", "｜DSML｜", "<think>", "</think>")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), 129280)


@pytest.fixture(scope="module")
def official() -> HFTokenizer:
    return HFTokenizer.from_file(str(bundled_tokenizer_json()))


def render_case(case: dict):
    request = case["request"]
    return render_conversation(
        request["messages"],
        tools=request.get("tools"),
        response_format=request.get("response_format"),
        thinking=case["thinking"],
        reasoning_effort=case["reasoning_effort"],
        drop_thinking=case["drop_thinking"],
    )


def test_corpus_covers_the_features() -> None:
    assert len(CASES) >= 40
    features = " ".join(case["feature"] for case in CASES)
    for needed in ("chat mode", "thinking mode", "reasoning effort max", "reasoning effort high", "drop rule"):
        assert needed in features
    roles = {m["role"] for case in CASES for m in case["request"]["messages"]}
    assert roles == {"system", "user", "assistant", "developer", "latest_reminder", "tool"}
    assert any("tools" in case["request"] for case in CASES)
    assert any("response_format" in case["request"] for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_corpus_renders_like_the_official_encoder(case: dict) -> None:
    assert render_case(case).text == case["expected"]


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_corpus_token_ids_match_official_tokenization(case: dict, tok: Tokenizer, official: HFTokenizer) -> None:
    """Rendered prompts tokenize as the official tokenizer.json tokenizes the official rendering,
    except that control-token strings inside client text stay plain text."""
    prompt = render_case(case)
    ids = tok.encode_prompt(prompt.parts)
    assert tok.decode(ids) == case["expected"]
    client_text = "".join(part for part in prompt.parts if isinstance(part, str))
    if any(s in client_text for s in SPECIAL_STRINGS):
        controls = [tok.token_id(part.text) for part in prompt.parts if isinstance(part, Control)]
        assert [i for i in ids if tok.is_added(i)] == controls
    else:
        assert ids == official.encode(case["expected"], add_special_tokens=False).ids


@pytest.mark.parametrize(("number", "thinking"), [(1, True), (2, True), (3, True), (4, False)])
def test_official_encoder_fixtures(number: int, thinking: bool) -> None:
    folder = SHARED / "fixtures" / "encoding"
    data = json.loads((folder / f"test_input_{number}.json").read_text(encoding="utf-8"))
    messages, tools = (data["messages"], data["tools"]) if isinstance(data, dict) else (data, None)
    expected = (folder / f"test_output_{number}.txt").read_text(encoding="utf-8")
    assert render_conversation(messages, tools=tools, thinking=thinking).text == expected


OFFICIAL_VECTORS = sorted((SHARED / "fixtures" / "ds4" / "test-vectors" / "official").glob("*.official.json"))


@pytest.mark.parametrize("path", OFFICIAL_VECTORS, ids=lambda p: p.name.split(".")[0])
def test_official_api_prompt_token_counts(path: Path, tok: Tokenizer) -> None:
    vector = json.loads(path.read_text(encoding="utf-8"))
    assert vector["request"]["thinking"] == {"type": "disabled"}
    prompt = render_conversation(vector["request"]["messages"], thinking=False)
    assert len(tok.encode_prompt(prompt.parts)) == vector["usage"]["prompt_tokens"]


def test_the_five_vectors_are_all_there() -> None:
    assert sorted(json.loads(p.read_text())["usage"]["prompt_tokens"] for p in OFFICIAL_VECTORS) == [
        18,
        21,
        27,
        3353,
        3844,
    ]


def test_user_text_with_control_strings_stays_plain(tok: Tokenizer) -> None:
    prompt = render_conversation([{"role": "user", "content": "<｜User｜>x｜DSML｜</think>"}], thinking=True)
    ids = tok.encode_prompt(prompt.parts)
    control = [tok.token_id(s) for s in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>")]
    assert [i for i in ids if tok.is_added(i)] == control
    assert tok.decode(ids) == prompt.text


def test_openai_content_parts_and_object_arguments() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}],
        },
    ]
    text = render_conversation(messages).text
    assert "<｜User｜>Hello there<｜Assistant｜></think>" in text
    assert '<｜DSML｜parameter name="a" string="false">[1]</｜DSML｜parameter>' in text


def test_non_object_json_arguments_render_verbatim() -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
    text = render_conversation([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]).text
    assert '<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>' in text


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([{"role": "robot", "content": "x"}], {}, "unknown role"),
        ([{"role": "developer", "content": ""}], {}, "needs content"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "medium"}, "reasoning_effort"),
        ([{"role": "user", "content": "x", "tools": []}], {}, None),
        ([{"role": "user", "content": "x", "tools": [{"type": "function"}]}], {}, "system or developer"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "only text content parts"),
        ([{"role": "user", "content": "x", "task": "poem"}], {}, "unknown task"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], {}, "function.name"),
        ([{"role": "user", "content": "x"}], {"tools": [{"type": "function"}]}, "a tool must be"),
        ("not a list", {}, "list of message objects"),
    ],
)
def test_malformed_conversations_are_prompt_errors(messages, kwargs: dict, message: str | None) -> None:
    if message is None:
        render_conversation(messages, **kwargs)  # an empty tools list is no tools at all
        return
    with pytest.raises(PromptError, match=message):
        render_conversation(messages, **kwargs)
