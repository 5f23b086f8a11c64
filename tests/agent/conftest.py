"""Shared fixtures of the agent tests: the bundled model on the reference backend, and an agent on it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dwarfstar.agent.files import Workspace
from dwarfstar.agent.loop import Agent, Events
from dwarfstar.agent.policy import Policy, ScriptedPolicy
from dwarfstar.agent.tools import Toolbox, ToolOutcome
from dwarfstar.agent.transcript import Transcript, system_text
from dwarfstar.console.chat import ThinkMode
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.prompt.dsml import ToolCall, render_tool_calls

MODEL_CTX = 8192


@pytest.fixture(scope="session")
def nano() -> Engine:
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=MODEL_CTX))


def calls(*pairs: tuple[str, dict]) -> str:
    """Tool calls as the model writes them in DSML."""
    return "".join(str(part) for part in render_tool_calls([ToolCall(name, args) for name, args in pairs]))


def reply(thought: str, text: str, *pairs: tuple[str, dict]) -> str:
    """A scripted reply: reasoning, the answer's text, then its tool calls."""
    return f"{thought}</think>{text}" + calls(*pairs)


class Recorder(Events):
    """Every event, in order, as (kind, payload) pairs."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def text(self, kind: str, text: str) -> None:
        if self.log and self.log[-1][0] == kind:
            self.log[-1] = (kind, self.log[-1][1] + text)
        else:
            self.log.append((kind, text))

    def reply_end(self, finish: str) -> None:
        self.log.append(("reply_end", finish))

    def tool_start(self, name: str, arguments: dict) -> None:
        self.log.append(("tool_start", name))

    def tool_end(self, name: str, outcome: ToolOutcome) -> None:
        self.log.append(("tool_end", (name, outcome)))

    def status(self, text: str) -> None:
        self.log.append(("status", text))

    def of(self, kind: str) -> list:
        return [payload for k, payload in self.log if k == kind]


def make_agent(
    engine: Engine, root: Path, policy: Policy, ctx: int = MODEL_CTX, mode: ThinkMode = ThinkMode.THINK
) -> Agent:
    return Agent(
        tokenizer=engine.tokenizer,
        backend=engine.backend,
        ctx=ctx,
        policy=policy,
        toolbox=Toolbox(Workspace(root)),
        transcript=Transcript(system_text(str(root), ""), mode),
        max_tokens=4096,
    )


@pytest.fixture
def scripted(nano: Engine, tmp_path: Path) -> Callable[..., Agent]:
    """An agent in tmp_path whose replies are the given texts."""

    def build(replies: list[str], ctx: int = MODEL_CTX) -> Agent:
        policy = ScriptedPolicy(nano.tokenizer, nano.backend.args.eos_token_id, replies)
        return make_agent(nano, tmp_path, policy, ctx)

    return build
