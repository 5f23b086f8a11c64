"""Reasoning-effort preambles by release (dwarfstar/prompt/efforts.py): the V4 preview's table and the
one DeepSeek's encoder uses from Flash 0731 and PRO 0813 on, which release a model file is, and what
the server, `run` and `agent` render for each."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import ConfigError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.prompt.efforts import DSPARK_RELEASES, PREVIEW, THINK_MAX_MIN_CTX, effort_level
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import DS4, OFFICIAL
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.controls import resolve_thinking
from dwarfstar.serving.service import Service

HELLO = [{"role": "user", "content": "Hello"}]
BOS, TAIL = "<｜begin▁of▁sentence｜>", "<｜User｜>Hello<｜Assistant｜><think>"
# the first line of each preamble, as the published encoders write them
ABSOLUTE = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
BEYOND = "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
BEYOND_END = "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"


def rendered(release: str, level: str | None, thinking: bool = True, options=OFFICIAL) -> str:
    return render_conversation(
        HELLO, thinking=thinking, reasoning_effort=level, options=replace(options, efforts=release)
    ).text


@pytest.mark.parametrize("options", [OFFICIAL, DS4], ids=["official", "ds4"])
def test_each_release_opens_a_thinking_prompt_with_its_own_preamble(options):
    plain = BOS + TAIL
    assert rendered(PREVIEW, None, options=options) == plain
    assert rendered(PREVIEW, "high", options=options) == plain
    assert rendered(PREVIEW, "max", options=options).startswith(BOS + ABSOLUTE)
    assert rendered(DSPARK_RELEASES, None, options=options) == plain
    assert rendered(DSPARK_RELEASES, "low", options=options) == plain
    high = rendered(DSPARK_RELEASES, "high", options=options)
    assert high == rendered(PREVIEW, "max", options=options)  # the preview's max text is 0731's high
    top = rendered(DSPARK_RELEASES, "max", options=options)
    assert top.startswith(BOS + BEYOND) and top.endswith(BEYOND_END + TAIL) and ABSOLUTE not in top
    assert (
        rendered(DSPARK_RELEASES, "max", thinking=False, options=options)
        == BOS + "<｜User｜>Hello<｜Assistant｜></think>"
    )


def test_api_effort_names_map_onto_each_release_s_levels():
    big, small = THINK_MAX_MIN_CTX, THINK_MAX_MIN_CTX - 1
    assert [effort_level(DSPARK_RELEASES, e, big) for e in ("minimal", "low", "medium", "high", "xhigh", "max")] == [
        None,
        None,
        "high",
        "high",
        "max",
        "max",
    ]
    assert effort_level(DSPARK_RELEASES, "max", small) == "high"  # Think-Max needs the big context
    assert [effort_level(PREVIEW, e, big) for e in ("low", "medium", "high", "xhigh", "max")] == [
        None,
        None,
        None,
        "max",
        "max",
    ]
    assert effort_level(PREVIEW, "max", small) is None
    assert effort_level(DSPARK_RELEASES, None, big) is None

    def resolve(effort, release, switch=None):
        return resolve_thinking(default=True, model="m", switch=switch, effort=effort, ctx=big, release=release)

    assert resolve("high", DSPARK_RELEASES).effort == "high"
    assert resolve("high", PREVIEW).effort is None
    assert resolve("max", DSPARK_RELEASES, switch=False).effort is None  # no thinking: no preamble
    assert not resolve("none", DSPARK_RELEASES).enabled


def read_back(written: dict) -> dict:
    """Metadata as a reader gives it: an array's values without their item type."""
    return {key: value[1] if kind is ValueType.ARRAY else value for key, (kind, value) in written.items()}


def ratios_meta(args: ModelArgs, ratios: list[int]) -> dict:
    return {**read_back(args.to_gguf_metadata()), "deepseek4.attention.compress_ratios": ratios}


def test_a_file_tells_its_release():
    n = TINY.n_layers
    ratios = list(TINY.compress_ratios[:n])
    assert ModelArgs.from_gguf_metadata(ratios_meta(TINY, ratios)).reasoning_efforts == PREVIEW
    # ds4 writes a DSpark release's trunk with its drafter stages' ratios after the layers'
    dspark = ModelArgs.from_gguf_metadata(ratios_meta(TINY, ratios + [0, 0, 0]))
    assert dspark.reasoning_efforts == DSPARK_RELEASES and dspark.n_layers == n
    assert ModelArgs.from_gguf_metadata(ratios_meta(TINY, ratios + [0])).reasoning_efforts == PREVIEW  # an MTP entry
    ours = TINY.with_(reasoning_efforts=DSPARK_RELEASES)  # our files say it in a key of their own
    written = ours.to_gguf_metadata()
    assert written["dwarfstar.reasoning_efforts"] == (ValueType.STRING, DSPARK_RELEASES)
    assert "dwarfstar.reasoning_efforts" not in TINY.to_gguf_metadata()
    assert ModelArgs.from_gguf_metadata(read_back(written)) == ours
    with pytest.raises(ConfigError, match="reasoning efforts of release '0999'"):
        ModelArgs.from_gguf_metadata({**ratios_meta(TINY, ratios), "dwarfstar.reasoning_efforts": "0999"})


@pytest.fixture(scope="module")
def dspark_release_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("efforts") / "tiny-0731.gguf"
    write_synthetic_model(path, TINY.with_(reasoning_efforts=DSPARK_RELEASES, max_seq_len=THINK_MAX_MIN_CTX), seed=0)
    return load_engine(EngineSpec(path, "reference", ctx=THINK_MAX_MIN_CTX))


def test_the_server_renders_a_request_s_effort_in_the_model_s_table(dspark_release_engine):
    service = Service(dspark_release_engine, ServerConfig(ctx=THINK_MAX_MIN_CTX))
    for effort, first in (("medium", ABSOLUTE), ("max", BEYOND), ("low", "<｜User｜>")):
        thinking = service.thinking("deepseek-v4-flash", True, effort)
        prompt, _ = service._render(HELLO, None, thinking, param="messages")
        assert prompt.text.startswith(BOS + first), effort


def test_run_and_agent_think_max_render_the_model_s_table(dspark_release_engine):
    from dwarfstar.agent.transcript import Transcript
    from dwarfstar.console.chat import Chat, ThinkMode
    from dwarfstar.sampling import SamplingParams

    engine = dspark_release_engine
    decode = engine.tokenizer.decode
    chat = Chat(
        engine,
        engine.backend,
        ctx=THINK_MAX_MIN_CTX,
        system="sys",
        mode=ThinkMode.THINK_MAX,
        params=SamplingParams(),
        max_tokens=4,
    )
    assert decode(chat.prompt_ids("Hello")).startswith(BOS + BEYOND)
    head = Transcript("sys", ThinkMode.THINK_MAX).head_ids(engine.tokenizer, engine.backend.args.reasoning_efforts)
    assert decode(head).startswith(BOS + BEYOND)
    assert decode(Transcript("sys", ThinkMode.THINK_MAX).head_ids(engine.tokenizer, PREVIEW)).startswith(BOS + ABSOLUTE)
