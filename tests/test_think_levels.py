"""V4.1 think levels (issue 33 item 5): the effort prefix and the `<｜System｜>` token in the prompt, the
API presets, `--think-level` on run and agent, and the release checks.

Expected prompts are the official V4.1 encoder's, as a third-party audit ran it and as
the sources in shared/spec/RELEASES_2026.md give it, written out here by hand.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import DSPARK_RELEASES, PREVIEW, V41, ModelArgs
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.prompt import PromptError, render_conversation
from dwarfstar.prompt.efforts import THINK_MAX_MIN_CTX, effort_level
from dwarfstar.prompt.render_options import DS4, OFFICIAL
from dwarfstar.tokenizer.specials import Control
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from tests.test_model_files import rewrite

BOS, SYSTEM = "<｜begin▁of▁sentence｜>", "<｜System｜>"
SYSTEM_ID = 128799  # `<｜System｜>` in V4.1's vocabulary; a placeholder in V4's
V41_OPTIONS = replace(OFFICIAL, efforts=V41)
SU = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
U = [{"role": "user", "content": "U"}]
NO_THINK_TAIL = "<｜User｜>U<｜Assistant｜></think>"
THINK_TAIL = "<｜User｜>U<｜Assistant｜><think>"


def prefix(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def v41(messages, thinking: bool, effort=None, options=V41_OPTIONS, **kw) -> str:
    return render_conversation(messages, thinking=thinking, reasoning_effort=effort, options=options, **kw).text


# -- the renderer ---------------------------------------------------------------------------------------------
def test_the_official_encoder_s_layouts():
    assert v41(SU, False) == BOS + SYSTEM + "S" + NO_THINK_TAIL
    assert v41(U, False) == BOS + NO_THINK_TAIL
    assert v41(SU, True) == BOS + SYSTEM + prefix(75) + "S" + THINK_TAIL  # high, the default
    assert v41(U, True) == BOS + SYSTEM + prefix(75) + THINK_TAIL
    turns = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "mid"},
        {"role": "user", "content": "q2"},
    ]
    assert v41(turns, False) == (
        BOS + SYSTEM + "S<｜User｜>q1<｜Assistant｜></think>a1<｜end▁of▁sentence｜>"
        + SYSTEM + "mid<｜User｜>q2<｜Assistant｜></think>"
    )  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert v41(SU, False, tools=[tool]).startswith(BOS + SYSTEM + "S\n\n## Tools\n\n")


@pytest.mark.parametrize(
    ("effort", "level"), [(1, 1), (75, 75), (100, 100), ("low", 50), ("high", 75), ("max", 100), (None, 75)]
)
def test_a_level_or_preset_is_the_prefix_of_the_first_system_message(effort, level):
    assert v41(SU, True, effort) == BOS + SYSTEM + prefix(level) + "S" + THINK_TAIL
    assert v41(U, True, effort) == BOS + SYSTEM + prefix(level) + THINK_TAIL
    assert v41(SU, False, effort) == BOS + SYSTEM + "S" + NO_THINK_TAIL  # only in thinking mode


@pytest.mark.parametrize("effort", [0, 101, -1, True, 7.5, "medium", "0"])
def test_the_renderer_refuses_other_levels(effort):
    with pytest.raises(PromptError, match="reasoning_effort"):
        v41(U, True, effort)


def test_ds4_s_layout_opens_its_system_block_with_the_token():
    ds4 = replace(DS4, efforts=V41)
    assert v41(SU, True, 30, options=ds4) == BOS + SYSTEM + prefix(30) + "S" + THINK_TAIL
    assert v41(U, True, options=ds4) == BOS + SYSTEM + prefix(75) + THINK_TAIL
    assert v41(U, False, options=ds4) == BOS + NO_THINK_TAIL


def test_the_system_token_is_a_control_token_and_text_never_becomes_one():
    parts = render_conversation(SU, thinking=True, reasoning_effort=20, options=V41_OPTIONS).parts
    assert parts[:3] == (Control(BOS), Control(SYSTEM), prefix(20) + "S")
    typed = render_conversation([{"role": "user", "content": SYSTEM}], options=V41_OPTIONS).parts
    assert Control(SYSTEM) not in typed and SYSTEM in typed


def test_v4_prompts_have_no_system_token_and_take_no_numbers():
    for release in (PREVIEW, DSPARK_RELEASES):
        options = replace(OFFICIAL, efforts=release)
        assert render_conversation(SU, options=options).text == BOS + "S" + NO_THINK_TAIL
        with pytest.raises(PromptError, match=f"needs a DeepSeek V4.1 model.*release '{release}'"):
            render_conversation(SU, thinking=True, reasoning_effort=75, options=options)


def test_api_effort_names_are_v41_presets():
    big, small = THINK_MAX_MIN_CTX, THINK_MAX_MIN_CTX - 1
    names = (None, "minimal", "low", "medium", "high", "xhigh", "max")
    assert [effort_level(V41, name, big) for name in names] == [75, 50, 50, 75, 75, 100, 100]
    assert effort_level(V41, "max", small) == 75  # as ds4's Think-Max: max needs the big context


# -- tokens -----------------------------------------------------------------------------------------------
def v41_vocabulary(path: Path) -> list[str]:
    """The synthetic model's V4 vocabulary with id 128799 named as V4.1 names it."""
    with GGUFFile(path) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"])
    tokens[SYSTEM_ID] = SYSTEM
    return tokens


@pytest.fixture(scope="module")
def v41_file(tmp_path_factory) -> Path:
    """A tiny synthetic model whose metadata names the V4.1 release, with V4.1's `<｜System｜>` token."""
    folder = tmp_path_factory.mktemp("v41")
    v4_vocab = folder / "v4-vocab.gguf"
    write_synthetic_model(v4_vocab, TINY.with_(reasoning_efforts=V41), seed=0)
    tokens = (ValueType.ARRAY, (ValueType.STRING, v41_vocabulary(v4_vocab)))
    return rewrite(v4_vocab, folder / "tiny-v41.gguf", meta={"tokenizer.ggml.tokens": tokens})


@pytest.fixture(scope="module")
def v41_engine(v41_file):
    return load_engine(EngineSpec(v41_file, "reference", ctx=4096))


def test_a_file_names_the_v41_release(v41_file):
    with GGUFFile(v41_file) as f:
        assert f.metadata["dwarfstar.reasoning_efforts"] == "v4.1"
        assert ModelArgs.from_gguf_metadata(f.metadata).reasoning_efforts == V41


def test_the_system_token_is_one_id_and_v4_s_vocabulary_has_none(v41_engine):
    parts = render_conversation(SU, thinking=True, reasoning_effort=100, options=V41_OPTIONS).parts
    ids = v41_engine.tokenizer.encode_prompt(parts)
    assert ids[:2] == [0, SYSTEM_ID] and ids.count(SYSTEM_ID) == 1
    assert v41_engine.tokenizer.decode(ids).startswith(BOS + SYSTEM + prefix(100) + "S")
    typed = render_conversation([{"role": "user", "content": SYSTEM}], options=V41_OPTIONS).parts
    assert SYSTEM_ID not in v41_engine.tokenizer.encode_prompt(typed)
    with pytest.raises(ModelFileError, match="no token '<｜System｜>'"):
        Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), TINY.vocab_size).encode_prompt(parts)  # V4's


# -- run and agent ------------------------------------------------------------------------------------------
def test_run_and_agent_heads_carry_the_level(v41_engine):
    from dwarfstar.agent.transcript import Transcript
    from dwarfstar.console.chat import Chat, ThinkMode
    from dwarfstar.sampling import SamplingParams

    engine = v41_engine
    decode = engine.tokenizer.decode

    def chat(mode, level=None):
        args = dict(ctx=4096, system="sys", mode=mode, params=SamplingParams(), max_tokens=4, level=level)
        return Chat(engine, engine.backend, **args)

    asked = "<｜User｜>Hello<｜Assistant｜>"
    leveled = chat(ThinkMode.THINK, 30).prompt_ids("Hello")
    assert decode(leveled) == BOS + SYSTEM + prefix(30) + "sys" + asked + "<think>"
    assert decode(chat(ThinkMode.THINK).prompt_ids("Hello")).startswith(BOS + SYSTEM + prefix(75) + "sys<")
    assert decode(chat(ThinkMode.THINK_MAX).prompt_ids("Hello")).startswith(BOS + SYSTEM + prefix(100) + "sys<")
    assert decode(chat(ThinkMode.NOTHINK).prompt_ids("Hello")) == BOS + SYSTEM + "sys" + asked + "</think>"
    switched = chat(ThinkMode.THINK, 30)
    switched.set_mode(ThinkMode.THINK)  # /think: ds4's 75 again
    assert decode(switched.prompt_ids("Hello")).startswith(BOS + SYSTEM + prefix(75))
    head = Transcript("sys", ThinkMode.THINK, level=5).head_ids(engine.tokenizer, V41)
    assert decode(head).startswith(BOS + SYSTEM + prefix(5) + "sys\n\n## Tools")


def test_think_level_flag_rules():
    from dwarfstar.commands.flags import SamplingFlags
    from dwarfstar.console.chat import ThinkMode

    assert SamplingFlags(think_level=0).mode() is ThinkMode.NOTHINK
    assert SamplingFlags(think_level=40).mode() is ThinkMode.THINK
    assert SamplingFlags(think_level=40).level(V41) == 40
    assert SamplingFlags(think_level=0).level(V41) is None and SamplingFlags().level(PREVIEW) is None
    with pytest.raises(DwarfStarError, match="without --think-max or --no-think"):
        SamplingFlags(think_level=40, think_max=True).mode()
    with pytest.raises(DwarfStarError, match="without --think-max or --no-think"):
        SamplingFlags(think_level=40, think=False).mode()
    with pytest.raises(DwarfStarError, match=r"--think-level needs a DeepSeek V4.1 model.*Flash 0731.*'0731'"):
        SamplingFlags(think_level=0).level(DSPARK_RELEASES)


def test_run_refuses_a_level_for_a_v4_model_and_out_of_range(tiny_model_file, v41_file):
    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app

    _register_commands()

    def run(*args):
        return CliRunner().invoke(app, ["run", "--backend", "reference", "-p", "hi", "-n", "1", *args])

    done = run("-m", str(tiny_model_file(0)), "--think-level", "50")
    assert isinstance(done.exception, DwarfStarError), done.output
    assert "--think-level needs a DeepSeek V4.1 model; this model is DeepSeek V4 preview" in str(done.exception)
    done = run("-m", str(v41_file), "--think-level", "101")
    assert done.exit_code == 2 and "--think-level" in done.output and "less than or equal to 100" in done.output
    done = run("-m", str(v41_file), "--think-level", "40", "--temp", "0")
    assert done.exit_code == 0, done.output


# -- serve ------------------------------------------------------------------------------------------------
def test_the_server_renders_a_request_s_level(v41_engine):
    from dwarfstar.serving.config import ServerConfig
    from dwarfstar.serving.service import Service

    def text(service, model="deepseek-v4-flash", switch=None, effort=None, level=None) -> str:
        thinking = service.thinking(model, switch, effort, level)
        return service._render(U, None, thinking, param="messages")[0].text

    service = Service(v41_engine, ServerConfig(ctx=4096, template="official"))
    assert text(service) == BOS + SYSTEM + prefix(75) + THINK_TAIL
    assert text(service, effort="low") == BOS + SYSTEM + prefix(50) + THINK_TAIL
    assert text(service, effort="max") == BOS + SYSTEM + prefix(75) + THINK_TAIL  # max needs 393,216 tokens
    assert text(service, level=100) == BOS + SYSTEM + prefix(100) + THINK_TAIL  # a number is taken as it is
    assert text(service, effort="low", level=30) == BOS + SYSTEM + prefix(30) + THINK_TAIL
    assert text(service, level=0) == BOS + NO_THINK_TAIL
    assert text(service, effort="none") == BOS + NO_THINK_TAIL
    assert text(service, switch=False, level=30) == BOS + SYSTEM + prefix(30) + THINK_TAIL  # the level wins
    assert text(service, model="deepseek-chat", level=30) == BOS + SYSTEM + prefix(30) + THINK_TAIL
    leveled = Service(v41_engine, ServerConfig(ctx=4096, template="official", think_level=40))
    assert text(leveled) == BOS + SYSTEM + prefix(40) + THINK_TAIL  # serve --think-level: the default
    assert text(leveled, effort="low") == BOS + SYSTEM + prefix(50) + THINK_TAIL
    off = Service(v41_engine, ServerConfig(ctx=4096, template="official", think_by_default=False, think_level=0))
    assert text(off) == BOS + NO_THINK_TAIL
    assert text(off, switch=True) == BOS + SYSTEM + prefix(75) + THINK_TAIL


def test_serve_s_think_level_needs_a_v41_model(tiny_model_file):
    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app
    from dwarfstar.serving.config import ServerConfig
    from dwarfstar.serving.service import Service

    engine = load_engine(EngineSpec(tiny_model_file(0), "reference", ctx=4096))
    with pytest.raises(DwarfStarError, match=r"^--think-level needs a DeepSeek V4.1 model; this model is DeepSeek V4 "):
        Service(engine, ServerConfig(ctx=4096, think_level=0))
    _register_commands()
    done = CliRunner().invoke(app, ["serve", "-m", str(tiny_model_file(0)), "--think-level", "50", "--no-think"])
    assert isinstance(done.exception, DwarfStarError) and "without --no-think" in str(done.exception)
