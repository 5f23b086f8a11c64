"""A live uvicorn on 127.0.0.1 serving the tiny random model, and SDK clients pointed at it.

The backend is wrapped by `ScriptedBackend`: when the last user turn carries `[[script:NAME]]`, the
logits after the prompt are steered so that sampling (greedy or not) produces SCRIPTS[NAME] token by
token (tool calls included), then EOS; `[[fail]]` makes the forward pass raise once two tokens have
been generated, as an engine failure would. Every other prompt gets the model's own random output.
It also counts the rows of each sampling call.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import replace

import anthropic
import httpx2 as httpx
import openai
import pytest
import torch
from live_server import LiveServer, start_server  # noqa: F401  (start_server: the tests import it from here)

from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.forward import forward_then_sample
from dwarfstar.model.state import SequenceState
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.sampling import Sampler, sample_batch
from dwarfstar.serving.config import ServerConfig
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.tokenizer import Tokenizer

API_KEY = "test-key"
DSML = "｜DSML｜"
WEATHER_CALL = (
    f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    # not the canonical spelling (which is compact JSON), so exact replay is visible in the prompt
    f'<{DSML}parameter name="days" string="false">{{"n": 3}}</{DSML}parameter>\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>"
)
SCRIPTS = {
    "hello": "Hello there, how can I help?",
    "weather": "Let me check." + WEATHER_CALL,
    "think_weather": "The user wants weather, so call the tool.</think>Checking." + WEATHER_CALL,
    "think_hello": "A greeting deserves a greeting.</think>Hello!",
    # control tokens where an answer has none: the sampler must refuse them (test_control_tokens.py)
    "role_token": "Hi<｜User｜> there",
    "think_role_token": "Plan<｜Assistant｜>ned.</think>Done<｜User｜>!",
    **{f"count{i}": f"Reply number {i}." for i in range(10)},
    "long_story": " ".join(f"w{i}" for i in range(200)),  # a generation that lasts a while
    "book": " ".join(f"w{i}" for i in range(3000)),  # one that no max_tokens up to 3000 lets end early
    "loop": "All work and no play. " * 10,  # what the loop guard ends (test_loop_guard.py)
    # long-context drift the parser repairs: a lookalike bracket, a lost underscore, no closing tag
    "drifted_weather": "Let me check."
    + WEATHER_CALL.replace(f"<{DSML}invoke", f"‹{DSML}invoke")
    .replace(f"\n</{DSML}tool_calls>", "")
    .replace("tool_calls", "toolcalls"),
    # a tool name the request did not declare (the tool-call guard's case, test_tool_guard.py)
    "misnamed_weather": "Let me check." + WEATHER_CALL.replace('"get_weather"', '"Get_weather"'),
    # a value the model ended inside: not repairable (the call's name is known by then)
    "broken_weather": "Let me check." + WEATHER_CALL[: WEATHER_CALL.index("Paris")],
    # a value never closed, with drifted structure inside it: the parser reads it all as the value
    "leaky_weather": "Let me check." + WEATHER_CALL[: WEATHER_CALL.index("Paris") + 5] + f"‹/{DSML}invoke>\n",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "object"}},
                "required": ["city"],
            },
        },
    }
]


MARKER = re.compile(r"\[\[(script:(\w+)|fail)\]\]")
MARGIN = 60.0  # logit lead of the scripted token: every other token's probability is below e^-60


class ScriptedBackend:
    def __init__(self, inner, tokenizer: Tokenizer, scripts: dict[str, str]) -> None:
        self.inner, self.args, self.tokenizer = inner, inner.args, tokenizer
        self.scripts = {name: tokenizer.encode_with_specials(text) for name, text in scripts.items()}
        self.user = tokenizer.token_id(specials.USER)
        self.assistant = tokenizer.token_id(specials.ASSISTANT)
        self.sampled_rows: list[int] = []  # how many requests each sampling call served

    def new_state(self) -> SequenceState:
        return self.inner.new_state()

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, images=None) -> torch.Tensor:
        self._maybe_fail([state])
        out = self.inner.forward(tokens, state, all_logits, images=images)
        self._steer(state)
        return out

    def forward_batch(self, token_lists, states: Sequence[SequenceState], all_logits: bool = False, images=None):
        self._maybe_fail(states)
        out = self.inner.forward_batch(token_lists, states, all_logits, images=images)
        for state in states:
            self._steer(state)
        return out

    def sample_batch(self, logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
        self.sampled_rows.append(logits.shape[0])
        return sample_batch(logits, samplers)

    def decode_sample(self, tokens, states, samplers):
        return forward_then_sample(self, tokens, states, samplers)  # through this double's forward_batch

    def _script(self, tokens: list[int]) -> tuple[str | None, int]:
        """The marker in the last user turn (None if none), and how many tokens follow the prompt."""
        try:
            answer = len(tokens) - 1 - tokens[::-1].index(self.assistant)
            user = answer - 1 - tokens[answer::-1].index(self.user)
        except ValueError:
            return None, 0
        text = [t for t in tokens[user + 1 : answer] if t < self.args.vocab_size]  # image blocks' ids are past it
        found = MARKER.search(self.tokenizer.decode(text))
        generated = len(tokens) - (answer + 2)  # after <｜Assistant｜> and the <think> or </think> marker
        return ((found.group(2) or "fail") if found else None), generated

    def _maybe_fail(self, states: Sequence[SequenceState]) -> None:
        for state in states:
            name, generated = self._script(state.tokens)
            if name == "fail" and generated >= 2:
                raise RuntimeError("scripted engine failure")

    def _steer(self, state: SequenceState) -> None:
        name, generated = self._script(state.tokens)
        if name is None or name == "fail" or generated < 0:
            return
        script = self.scripts[name]
        target = script[generated] if generated < len(script) else self.tokenizer.eos_id
        logits = state.logits.clone()
        logits[target] = logits.max() + MARGIN
        state.logits = logits


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    engine = load_engine(EngineSpec(path, "reference", ctx=4096))
    engine.backend = ScriptedBackend(engine.backend, engine.tokenizer, SCRIPTS)
    return engine


BASE_CONFIG = ServerConfig(
    ctx=4096, api_key=API_KEY, max_sessions=4, max_queue=16, prefill_chunk=256, keepalive_seconds=0.3
)


@pytest.fixture(scope="session")
def server(engine, tmp_path_factory) -> Iterator[LiveServer]:
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    yield from start_server(engine, replace(BASE_CONFIG, trace=trace))


@pytest.fixture(scope="session")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client
