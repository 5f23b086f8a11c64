"""MTP speculation in the agent: the bundled model with its bundled MTP block gives, at temperature 0,
the replies plain decoding gives, across turns, after the session is cut back under the speculator
(a new session), and from the command line; bad MTP flags are clear errors."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Recorder, make_agent

from dwarfstar.agent.loop import Agent
from dwarfstar.agent.policy import SampledPolicy, SpeculativePolicy
from dwarfstar.agent.transcript import Transcript
from dwarfstar.engine.load import Engine
from dwarfstar.prompt.efforts import PREVIEW
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.session import Cancelled
from dwarfstar.speculative.decode import load_speculation
from dwarfstar.speculative.mtp_options import MTPOptions

REPLY_TOKENS = 16
# the command's replies: to TURNS[0] the bundled model first makes one or two tool calls (often
# malformed), then answers, in about 50-110 tokens
CLI_REPLY_TOKENS = 64
TURNS = ("Quel ramo del lago di Como", "e poi?")
GREEDY = SamplingParams(temperature=0)


def agents(nano: Engine, root: Path) -> tuple[Agent, Agent, SpeculativePolicy]:
    eos = nano.backend.args.eos_token_id
    policy = SpeculativePolicy(GREEDY, eos, load_speculation(MTPOptions(None, 2), nano.backend, nano.model))
    plain, speculative = make_agent(nano, root, SampledPolicy(GREEDY, eos)), make_agent(nano, root, policy)
    policy.start(speculative.session)
    for agent in (plain, speculative):
        agent.max_tokens = REPLY_TOKENS
    return plain, speculative, policy


def replies(agent: Agent) -> list[list[int]]:
    return [e.ids for e in agent.transcript.entries if e.kind == "assistant"]


def test_speculative_replies_equal_plain_ones_across_turns_and_a_new_session(nano: Engine, tmp_path: Path) -> None:
    plain, speculative, policy = agents(nano, tmp_path)
    for text in TURNS:
        results = [agent.run(text, Recorder()) for agent in (plain, speculative)]
        assert results[0] == results[1]
    assert replies(speculative) == replies(plain) and all(replies(plain))
    assert speculative.session.tokens == plain.session.tokens
    first = policy.speculator
    assert first is not None and first.stats.steps > 0 and sum(first.stats.accepted) > 0  # it did draft
    # a new session cuts the context back to the system prompt: the speculator restarts there
    for agent in (plain, speculative):
        agent.new_transcript(Transcript(agent.transcript.system, agent.transcript.mode))
        agent.run(TURNS[0], Recorder())
    assert policy.speculator is not first and policy.finished == [first.stats]
    assert replies(speculative) == replies(plain) and speculative.session.tokens == plain.session.tokens
    assert "mtp N=2 next: " in policy.describe()


def test_a_stopped_prompt_leaves_the_session_valid_and_followed(nano: Engine, tmp_path: Path) -> None:
    """ESC during a speculative prefill: Cancelled at a chunk boundary, as Session.prefill does, and the
    speculator still follows the session (the next reply speculates without restarting)."""
    plain, speculative, policy = agents(nano, tmp_path)
    first = policy.speculator
    ids = speculative.transcript.head_ids(nano.tokenizer, PREVIEW)
    with pytest.raises(Cancelled, match=f"stopped after 0 of {len(ids)} prompt tokens"):
        policy.extend(speculative.session, ids, lambda: True)
    assert speculative.session.tokens == [] and policy.followed == []
    for agent in (plain, speculative):
        agent.run(TURNS[0], Recorder())
    assert policy.speculator is first and first.stats.steps > 0
    assert replies(speculative) == replies(plain)


def test_a_reply_read_in_part_leaves_exactly_the_tokens_read(nano: Engine, tmp_path: Path) -> None:
    """The loop stops reading at EOS; a caller may stop anywhere, even in the middle of a verified step
    (whose tokens the speculator already ran): the session then holds exactly the tokens yielded."""
    plain, speculative, policy = agents(nano, tmp_path)
    prompt = plain.transcript.head_ids(nano.tokenizer, PREVIEW) + nano.tokenizer.encode(TURNS[0])
    plain.session.prefill(prompt)
    expected = list(plain.policy.reply(plain.session, 8, lambda: False))
    policy.extend(speculative.session, prompt, lambda: False)
    for count in (1, 2, 3, 5, 8):
        speculative.session.truncate(len(prompt))
        stream = policy.reply(speculative.session, 8, lambda: False)
        taken = list(itertools.islice(stream, count))
        stream.close()
        assert taken == expected[:count]
        assert speculative.session.tokens == prompt + taken
    assert sum(s.steps for s in [*policy.finished, policy.speculator.stats]) > 0


def agent_cli(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path / "home"), DWARFSTAR_KVCACHE=str(tmp_path / "kv"), NO_COLOR="1")
    argv = [sys.executable, "-m", "dwarfstar", "agent", "--plain", "--backend", "reference", "--temp", "0"]
    argv += ["-n", str(CLI_REPLY_TOKENS), "--ctx", "4096", "-p", TURNS[0], *flags]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_the_agent_command_speculates_with_the_mtp_flags(tmp_path: Path) -> None:
    """The reply's words depend on the workspace path in the system prompt (tmp_path differs from run
    to run and between xdist workers), so the test asserts only what every path gives: at least one
    tool round (malformed or not), an answer, and the same transcript with and without speculation."""
    plain, speculative = agent_cli(tmp_path), agent_cli(tmp_path, "--mtp-draft", "2")
    assert plain.returncode == speculative.returncode == 0, speculative.stderr
    reply = plain.stdout.split("\n[")[0]  # the tool rounds and the answer, before the stats line
    rounds = re.search(r"^\[\w+, (\d+) tool rounds", plain.stdout, re.MULTILINE)
    assert rounds is not None and int(rounds[1]) >= 1 and reply.splitlines()[-1].strip(), plain.stdout
    assert speculative.stdout.split("\n[")[0] == reply
    assert "mtp N=2 next: " in speculative.stderr + speculative.stdout
    assert "mtp N=" not in plain.stderr + plain.stdout


def test_bad_mtp_flags_are_clear_errors(tmp_path: Path) -> None:
    for flags, message in (
        (("--mtp-draft", "9"), "--mtp-draft must be in 1..8"),
        (("--mtp-draft", "2", "--mtp-align", "sideways"), "unknown MTP alignment 'sideways'"),
        (("--mtp", str(tmp_path / "missing.gguf")), "missing.gguf"),
        (("--mtp-draft", "2", "--power", "50"), "speculative decoding needs a backend built on the shared forward"),
    ):
        done = agent_cli(tmp_path, *flags)
        assert done.returncode != 0 and message in done.stderr + done.stdout, (flags, done.stderr)
        assert "Traceback" not in done.stderr


def test_the_context_warning_is_for_a_ctx_the_user_set(tmp_path: Path) -> None:
    """The default --ctx (100000) quietly becomes the bundled model's 65536; a --ctx the user gives
    beyond it is named. (Both runs stop at the speculation refusal, after the warning would print.)"""
    env = dict(os.environ, HOME=str(tmp_path / "home"), DWARFSTAR_KVCACHE=str(tmp_path / "kv"), NO_COLOR="1")
    argv = [sys.executable, "-m", "dwarfstar", "agent", "--plain", "--backend", "reference", "-p", "hi"]
    argv += ["--mtp-draft", "2", "--power", "50"]
    default, given = (
        subprocess.run(argv + extra, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        for extra in ([], ["--ctx", "100000"])
    )
    assert "speculative decoding needs" in default.stderr + default.stdout
    assert "more than this model holds" not in default.stderr + default.stdout
    assert "--ctx 100000 is more than this model holds; using 65536" in given.stderr + given.stdout
