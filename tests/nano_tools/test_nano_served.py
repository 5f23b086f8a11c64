"""The bundled nano model as a real user of the serving paths: tool calls on held-out requests through
the official `openai` and `anthropic` SDKs, full tool round trips with exact DSML replay, and thinking
streamed as reasoning in each API's own shape (issue 19).

The server is `dwarfstar serve`'s app (its default ds4 template) on a loopback uvicorn. Tool requests
run at temperature 0 with thinking off. Thinking turns are sampled (the server resets sampling in
thinking mode, as ds4 does): the chat request sends a seed; the Responses and Messages APIs have no
seed field (ds4 reads none there either), so those tests fix the seed that a request without one
draws, and every run samples the same tokens. `DWARFSTAR_TEST_NANO=FILE` checks another file (a
candidate before it replaces `dwarfstar/data/nano.gguf`):

    DWARFSTAR_TEST_NANO=build/nano/nano.gguf .venv/bin/python -m pytest tests/nano_tools/test_nano_served.py -s
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import anthropic
import openai
import pytest
from live_server import LiveServer, start_server

from dwarfstar import sampling
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.serving.config import ServerConfig
from dwarfstar.train import chat_data
from dwarfstar.train.corpus import Split, read_split

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
MODEL = "deepseek-v4-flash"
REQUESTS_PER_API = 20
SUCCESS = 0.9
CALL_TOKENS = 80  # a DSML call of one short argument is about 45 tokens
RESULT = "Renzo e Lucia stavano aspettando davanti alla chiesa, e don Abbondio non arrivava mai."
QUOTED_WORDS = 4  # the answer quotes at least this many consecutive words of the result
THINK_PROMPT = "Quel ramo del lago di Como"
THINK_TOKENS = 300  # the reasoning is one book sentence, some run past 100 tokens
THINK_SEED = 7  # the chat request's seed, and the one a Responses or Messages request draws here


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineSpec(os.environ.get("DWARFSTAR_TEST_NANO") or default_model_path(), "reference", ctx=4096))


@pytest.fixture(scope="module")
def split() -> Split:
    return read_split(CORPUS)


@pytest.fixture(scope="module")
def served(engine: Engine, tmp_path_factory) -> Iterator[LiveServer]:
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    yield from start_server(engine, ServerConfig(ctx=4096, max_sessions=2, prefill_chunk=512, trace=trace))


def records(served: LiveServer, api: str) -> list[dict]:
    return [r for r in served.trace_records() if r["api"] == api]


@pytest.fixture(scope="module")
def oai(served: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(served: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture
def fixed_fresh_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request without a seed samples with THINK_SEED instead of a fresh random one."""

    class Fixed:
        def randrange(self, stop: int) -> int:
            return THINK_SEED

    monkeypatch.setattr(sampling, "random", SimpleNamespace(SystemRandom=Fixed))
    assert sampling.Sampler(sampling.SamplingParams()).seed == THINK_SEED  # the server's draws use it


def heldout_requests(split: Split, seed: int) -> list[chat_data.ToolRequest]:
    return chat_data.tool_requests(split.train, REQUESTS_PER_API, seed, heldout=True)


# -- each API's tool call and its reply --------------------------------------------------------------
def chat_call(oai: openai.OpenAI, request: chat_data.ToolRequest) -> tuple[str, dict, list[dict]]:
    """(tool name, arguments, the messages of the next turn with the tool's result)."""
    messages = [{"role": "user", "content": request.text}]
    reply = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=chat_data.TOOLS["chat"], max_tokens=CALL_TOKENS, temperature=0,
        extra_body={"thinking": {"type": "disabled"}},
    )  # fmt: skip
    message = reply.choices[0].message
    if not message.tool_calls:
        return "", {}, []
    (call,) = message.tool_calls
    turn = [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    return call.function.name, json.loads(call.function.arguments), messages + turn


def chat_answer(oai: openai.OpenAI, messages: list[dict]) -> str:
    reply = oai.chat.completions.create(
        model=MODEL, messages=messages, tools=chat_data.TOOLS["chat"], max_tokens=CALL_TOKENS, temperature=0,
        extra_body={"thinking": {"type": "disabled"}},
    )  # fmt: skip
    return reply.choices[0].message.content or ""


def responses_call(oai: openai.OpenAI, request: chat_data.ToolRequest) -> tuple[str, dict, list[dict]]:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": request.text}]}]
    reply = oai.responses.create(
        model=MODEL, input=items, tools=chat_data.TOOLS["responses"], max_output_tokens=CALL_TOKENS,
        temperature=0, reasoning={"effort": "none"},
    )  # fmt: skip
    calls = [item for item in reply.output if item.type == "function_call"]
    if not calls:
        return "", {}, []
    (call,) = calls
    result = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    replay = [item.model_dump(exclude_none=True) for item in reply.output]
    return call.name, json.loads(call.arguments), items + replay + [result]


def responses_answer(oai: openai.OpenAI, items: list[dict]) -> str:
    reply = oai.responses.create(
        model=MODEL, input=items, tools=chat_data.TOOLS["responses"], max_output_tokens=CALL_TOKENS,
        temperature=0, reasoning={"effort": "none"},
    )  # fmt: skip
    return reply.output_text


def messages_call(claude: anthropic.Anthropic, request: chat_data.ToolRequest) -> tuple[str, dict, list[dict]]:
    messages = [{"role": "user", "content": request.text}]
    reply = claude.messages.create(
        model=MODEL, messages=messages, tools=chat_data.TOOLS["messages"], max_tokens=CALL_TOKENS,
        thinking={"type": "disabled"}, extra_body={"temperature": 0},  # a field this SDK lacks
    )  # fmt: skip
    uses = [block for block in reply.content if block.type == "tool_use"]
    if not uses:
        return "", {}, []
    (use,) = uses
    turn = [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    return use.name, use.input, messages + turn


def messages_answer(claude: anthropic.Anthropic, messages: list[dict]) -> str:
    reply = claude.messages.create(
        model=MODEL, messages=messages, tools=chat_data.TOOLS["messages"], max_tokens=CALL_TOKENS,
        thinking={"type": "disabled"}, extra_body={"temperature": 0},  # a field this SDK lacks
    )  # fmt: skip
    return "".join(block.text for block in reply.content if block.type == "text")


APIS = {
    "chat": (chat_call, chat_answer, "oai"),
    "responses": (responses_call, responses_answer, "oai"),
    "messages": (messages_call, messages_answer, "claude"),
}


def quotes(answer: str, result: str) -> bool:
    words = result.split()
    return any(" ".join(words[i : i + QUOTED_WORDS]) in answer for i in range(len(words) - QUOTED_WORDS + 1))


# -- tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", sorted(APIS))
def test_heldout_tool_requests_call_the_right_tool_with_the_argument(api: str, split: Split, request) -> None:
    call, _, client = APIS[api]
    sdk = request.getfixturevalue(client)
    requests = heldout_requests(split, seed=sorted(APIS).index(api))
    right = []
    for tool_request in requests:
        name, arguments, _ = call(sdk, tool_request)
        right.append(
            name == tool_request.tool
            and arguments == {chat_data.TOOLS_CORE[tool_request.tool].parameter: tool_request.argument}
        )
    print(f"{api}: {sum(right)} of {len(right)} held-out requests called the right tool with the argument")
    assert sum(right) >= SUCCESS * len(right)


@pytest.mark.parametrize("api", sorted(APIS))
def test_round_trip_replays_the_sampled_dsml_and_quotes_the_result(
    api: str, split: Split, served: LiveServer, request
) -> None:
    call, answer, client = APIS[api]
    sdk = request.getfixturevalue(client)
    tool_request = heldout_requests(split, seed=10 + sorted(APIS).index(api))[0]
    name, arguments, next_turn = call(sdk, tool_request)
    # a call the client can run: the right tool, its one parameter (the argument's exact copy is the
    # held-out test's measure; a miscopied path here still gets the result and goes on)
    print(f"{api}: {tool_request.text!r} -> {name} {arguments}")
    assert name == tool_request.tool and list(arguments) == [chat_data.TOOLS_CORE[tool_request.tool].parameter]
    first = records(served, api)[-1]
    text = answer(sdk, next_turn)
    second = records(served, api)[-1]
    assert quotes(text, RESULT), text
    # the second prompt holds the call block byte for byte as it was sampled, after the first prompt
    assert first["dsml"] and first["prompt"] + first["dsml"] in second["prompt"]
    assert len(second["replayed_tool_ids"]) == 1


def test_chat_completions_stream_reasoning_then_content(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": THINK_PROMPT}],
            max_tokens=THINK_TOKENS,
            stream=True,
            seed=THINK_SEED,
            extra_body={"thinking": {"type": "enabled"}},
        )  # fmt: skip
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert reasoning.strip() and "".join(d.content or "" for d in deltas).strip()
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])
    assert any(getattr(d, "reasoning_content", None) for d in deltas[:first_content])


def test_responses_stream_a_reasoning_item_then_the_message(oai: openai.OpenAI, fixed_fresh_seed: None) -> None:
    events = list(
        oai.responses.create(
            model=MODEL,
            input=THINK_PROMPT,
            max_output_tokens=THINK_TOKENS,
            stream=True,
            reasoning={"effort": "high", "summary": "auto"},
        )  # fmt: skip
    )
    kinds = [e.type for e in events]
    last_reasoning = max(i for i, k in enumerate(kinds) if k == "response.reasoning_summary_text.delta")
    first_text = kinds.index("response.output_text.delta")
    assert last_reasoning < first_text
    reasoning, message = events[-1].response.output
    assert reasoning.type == "reasoning" and reasoning.summary[0].text.strip()
    assert message.type == "message" and message.content[0].text.strip()


def test_messages_stream_a_thinking_block_then_text(claude: anthropic.Anthropic, fixed_fresh_seed: None) -> None:
    with claude.messages.stream(
        model=MODEL, max_tokens=THINK_TOKENS, messages=[{"role": "user", "content": THINK_PROMPT}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:  # fmt: skip
        events = list(stream)
        message = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.thinking.strip() and text.text.strip()
