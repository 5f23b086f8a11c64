"""Agent-shaped training turns (dwarfstar/train/agent_data.py) and the kept prefix states that train on
them (dwarfstar/train/prefix_states.py); the bare requests, and the twin pairs the bare finder's
planting ties (dwarfstar/train/copy_tokens.py): without the short samples' fixed text (`TwinSet.FREE`,
`TwinSet.ARGUMENTS`), what a sample holds around its argument (the template's words, the tools'
names, the call's markup, a greeting and its answer) is no twin, while most bare arguments' first
tokens still are."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.loader import open_model
from dwarfstar.prompt.dsml_parser import parse_completion
from dwarfstar.tokenizer.specials import ASSISTANT, EOS, USER
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.agent_data import agent_samples, agent_turns, request_templates
from dwarfstar.train.agent_prompts import SHAPES, agent_prompt
from dwarfstar.train.chat_data import bare, bare_value, tool_requests, tool_samples
from dwarfstar.train.copy_tokens import TwinSet, bare_leads, quote_openers, twin_pieces, twin_set
from dwarfstar.train.corpus import read_split
from dwarfstar.train.greetings import GREETINGS, HELDOUT_GREETINGS
from dwarfstar.train.prefix_states import PrefixStates, run_prefixes

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
pytestmark = pytest.mark.skipif(not CORPUS.exists(), reason="needs ../shared (the corpus)")
TOKENS = (4000, 5000)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), 129280)


@pytest.fixture(scope="module")
def book() -> str:
    return read_split(CORPUS).train


def count(tokenizer: Tokenizer):
    return lambda text: len(tokenizer.encode(text))


def test_requests_come_bare_quoted_and_backticked_and_held_out_ones_are_new(book: str) -> None:
    forms = [t for _, _, t in request_templates(heldout=False)]
    assert any("`{}`" in t for t in forms) and any('"{}"' in t for t in forms)
    assert any("`" not in t and '"' not in t for t in forms)
    assert bare("leggi il file `{}`") == "leggi il file {}" and bare('cerca "{}"') == "cerca {}"
    train = {t.text for t in agent_turns(book, 300, 0, heldout=False)}
    heldout = agent_turns(book, 300, 0, heldout=True)
    assert not train & {t.text for t in heldout}
    assert {g for g, _, _ in GREETINGS}.isdisjoint(g for g, _, _ in HELDOUT_GREETINGS)
    kinds = {t.kind for t in heldout}
    assert kinds == {"greeting", "read", "list", "search"}


@pytest.mark.parametrize(("share", "low", "high"), [(0.0, 0, 0), (0.5, 120, 180), (1.0, 300, 300)])
def test_the_greeting_share_is_the_share_of_turns_that_are_greetings(book: str, share: float, low: int, high: int):
    turns = agent_turns(book, 300, 0, heldout=False, greeting_share=share)
    greetings = [t for t in turns if t.kind == "greeting"]
    assert low <= len(greetings) <= high
    assert all(t.answer and not t.argument for t in greetings)


@pytest.mark.parametrize("shape", SHAPES)
def test_samples_train_only_the_assistant_and_calls_carry_the_argument(shape: str, tokenizer: Tokenizer, book: str):
    prompt = agent_prompt(shape, 3, TOKENS, count(tokenizer))
    samples = agent_samples(prompt, book, tokenizer, 12, 0)
    turns = agent_turns(book, 12, 0, heldout=False)
    assistant, eos = tokenizer.token_id(ASSISTANT), tokenizer.token_id(EOS)
    prefixes = {s.ids[: s.prefix].tobytes() for s in samples}
    assert len(prefixes) == 1  # one prompt: one state for all of its turns
    for sample, turn in zip(samples, turns, strict=True):
        assert sample.prefix >= TOKENS[0] // 2 and not sample.trained[: sample.prefix].any()
        first = int(np.flatnonzero(sample.ids == assistant)[0])
        reply = tokenizer.decode(sample.ids[first + 1 : int(np.flatnonzero(sample.ids == eos)[0])].tolist())
        parsed = parse_completion(reply.removeprefix("<think>"), thinking=True, ended=True)
        if turn.kind == "greeting":
            assert sample.argument == (0, 0) and not parsed.tool_calls and parsed.content == turn.answer
            continue
        (call,) = parsed.tool_calls
        assert (call.name, call.arguments) == prompt.core[turn.kind].call(turn.argument, turn.request.quoted)
        start, end = sample.argument
        assert turn.argument in tokenizer.decode(sample.ids[start:end].tolist())
        assert sample.trained[start - 1 : end].all()


def _holds(ids: list[int], run: list[int]) -> bool:
    return any(ids[i : i + len(run)] == run for i in range(len(ids) - len(run) + 1))


@pytest.mark.parametrize("shape", ["messages", "responses"])
def test_a_shell_call_writes_the_argument_in_the_requests_own_tokens(shape: str, tokenizer: Tokenizer, book: str):
    """Claude Code's `ls` and Codex's `cat`/`ls`/`grep`: the argument in the command is a run of the
    request's token ids, whether the request backticks, quotes or leaves it bare (what a model copies;
    `cat altrettali.txt` after `` `altrettali.txt` `` would need ` alt`, which the request never holds).
    A bare text of two words is the exception: the shell needs it quoted, so its first token differs."""
    prompt = agent_prompt(shape, 3, TOKENS, count(tokenizer))
    turns = agent_turns(book, 40, 1, heldout=False)
    samples = agent_samples(prompt, book, tokenizer, 40, 1)
    assistant = tokenizer.token_id(ASSISTANT)
    forms = set()
    for sample, turn in zip(samples, turns, strict=True):
        request = turn.request
        if turn.kind == "greeting" or prompt.core[turn.kind].value == "{}":
            continue
        forms.add(request.quoted)
        if not request.quoted and " " in turn.argument:
            continue
        ids = sample.ids.tolist()
        user = ids[sample.prefix : ids.index(assistant)]
        start, end = sample.argument
        runs = [ids[i:j] for i in range(start, end) for j in range(i + 1, end + 1)]
        copied = [r for r in runs if tokenizer.decode(r).strip() == turn.argument]
        assert any(_holds(user, r) for r in copied), (turn.text, tokenizer.decode(ids[start:end]))
    assert forms == {True, False}


def test_a_bare_arguments_value_opens_with_its_first_tokens_text_then_copies_the_request(
    tokenizer: Tokenizer, book: str
) -> None:
    """A value that is the argument itself (`Read`'s `file_path`, the tools prompts' `path`), after a
    bare request, in agent turns and in the short tools prompts' samples: the request holds the
    argument after a space (` divor`, `ato`), so the value opens with ids spelling that first token's
    text without the space (`divor`) and the rest is a run of the request's own ids (`ato`), which the
    call copies; a quoted request's value is a run of the request's ids from its first token."""
    prompt = agent_prompt("messages", 3, TOKENS, count(tokenizer))
    turns = [t.request if t.kind != "greeting" else None for t in agent_turns(book, 40, 2, heldout=False)]
    requests = tool_requests(book, 40, 4, heldout=False, unquoted=0.5)
    pairs = [
        *zip(turns, agent_samples(prompt, book, tokenizer, 40, 2), strict=True),
        *zip(requests, tool_samples(book, tokenizer, 40, 4, 0.0, unquoted=0.5), strict=True),
    ]
    assistant = tokenizer.token_id(ASSISTANT)
    forms = set()
    for request, sample in pairs:
        ids = sample.ids.tolist()
        start, end = sample.argument
        value = ids[start:end]
        if request is None or tokenizer.decode(value) != request.argument:
            continue  # a greeting, or a shell command (the test above)
        user = ids[sample.prefix : ids.index(assistant)]
        if request.quoted:
            assert _holds(user, value), request.text
        else:
            # the request's token ` X` for the value's first k ids spelling `X`, then the value's rest
            led = [(tokenizer.encode(" " + tokenizer.decode(value[:k])), k) for k in range(1, len(value) + 1)]
            assert any(len(t) == 1 and _holds(user, t + value[k:]) for t, k in led), (
                request.text,
                [tokenizer.decode([i]) for i in value],
            )
        forms.add(request.quoted)
    assert forms == {True, False}


@pytest.mark.parametrize("heldout", [False, True], ids=["training", "held-out"])
def test_a_bare_argument_follows_a_lead_and_opens_with_the_spaced_half_of_a_twin(
    heldout: bool, tokenizer: Tokenizer, book: str
) -> None:
    """What the copy circuit's bare finder relies on (dwarfstar/train/induction.py): in every bare
    request, training or held-out template, the token before the argument is one of `bare_leads`;
    and for most arguments the call's first id (`bare_value`) is the twin (`twin_pieces`) of the
    request's first argument token (` divor` -> `divor`), which the finder writes."""
    leads, twins = set(bare_leads(tokenizer)), dict(twin_pieces(tokenizer))
    assert all(tokenizer.decode([b]) == tokenizer.decode([a])[1:] for a, b in twins.items())
    requests = tool_requests(book, 200, 5, heldout=heldout, unquoted=1.0)
    paired = 0
    for request in requests:
        ids, argument = tokenizer.encode(request.text), tokenizer.encode(" " + request.argument)
        start = next(i for i in range(len(ids)) if ids[i : i + len(argument)] == argument)
        assert ids[start - 1] in leads, request.text
        paired += twins.get(argument[0]) == bare_value(request.argument, tokenizer)[0]
    assert 0.6 * len(requests) <= paired < len(requests), paired


def test_a_turn_reasons_in_one_sentence_or_not_at_all(tokenizer: Tokenizer, book: str) -> None:
    """`reasoning=False`: a thinking turn's reasoning is empty (`<think></think>`, the reply deciding
    right after it), the round trip's answer's too; otherwise each is its sentence. The rest of the
    turn is the same."""
    prompt = agent_prompt("messages", 3, TOKENS, count(tokenizer))
    think = tokenizer.token_id("<think>")
    pairs = zip(
        agent_samples(prompt, book, tokenizer, 12, 0),
        agent_samples(prompt, book, tokenizer, 12, 0, reasoning=False),
        strict=True,
    )
    thinking = 0
    for sentence, empty in pairs:
        reply, short = (tokenizer.decode(s.ids[s.prefix :].tolist()) for s in (sentence, empty))
        if think not in sentence.ids[sentence.prefix :]:
            assert reply == short  # a turn without thinking is untouched
            continue
        thinking += 1
        assert "<think></think>" in short and "<think></think>" not in reply
        assert short == re.sub("<think>.+?</think>", "<think></think>", reply)
    assert thinking >= 6


def test_a_kept_prefix_state_is_the_fresh_run_until_it_is_too_old() -> None:
    model = ReferenceModel(open_model(default_model_path()))
    ids = torch.arange(100, 400)
    tail = torch.arange(500, 520)
    kept = PrefixStates(max_age=3)
    (fresh,) = run_prefixes(model, {b"p": ids}).values()
    (expected,) = model.hidden_batch([tail], [fresh])
    for step in range(3):
        (got,) = model.hidden_batch([tail], [kept.fork(model, b"p", ids, step)])  # each fork is a copy
        assert torch.equal(got, expected)
    assert kept.runs == 1
    kept.fork(model, b"p", ids, 3)
    assert kept.runs == 2


@pytest.mark.parametrize("kind", ["agent", "tools"])
@pytest.mark.parametrize("autograd", [False, True])
def test_a_turn_trains_its_prompt_only_under_autograd(kind: str, autograd: bool, tokenizer: Tokenizer, book: str):
    """`Trainer.hidden` on an agent turn (`agent_autograd`) and on a short tools prompt's round trip
    (`tool_autograd`): the same rows from the prompt's state (detached, as at inference) and from
    the whole run with autograd, but only the whole run's gradient reaches the prompt (here: the
    embeddings of ids that occur only there)."""
    from types import SimpleNamespace

    from dwarfstar.train.chat_data import tool_samples
    from dwarfstar.train.params import ParamWeights, compact
    from dwarfstar.train.trainer import NANO, Recipe, Trainer, shared_prefix, warm_params

    if kind == "agent":
        prompt = agent_prompt("responses", 3, (1500, 2000), count(tokenizer))
        sample = shared_prefix(agent_samples(prompt, book, tokenizer, 2, seed=3))[0]
        recipe, agent_keys = Recipe(agent_autograd=autograd), {sample.ids[: sample.prefix].tobytes()}
    else:
        sample = tool_samples(book, tokenizer, 1, seed=3, thinking_share=0.0)[0]
        recipe, agent_keys = Recipe(tool_autograd=autograd), set()
    vocab = torch.arange(NANO.vocab_size - 1)  # every id but one, whose output row is the "rest" one
    params = compact(warm_params(default_model_path(), NANO, vocab), vocab)
    params["token_embd.weight"].requires_grad_(True)
    # as the trainer's: QAT rounding off (the reference's cached rotation for it may come from inference mode)
    model = ReferenceModel.from_weights(NANO.with_(vocab_size=vocab.numel()), ParamWeights(params), qat=False)
    trainer = SimpleNamespace(recipe=recipe, agent_keys=agent_keys, local=vocab, agent_states=PrefixStates(1), step=0)
    rows = Trainer.hidden(trainer, model, [sample])
    assert rows.shape[0] == len(sample.ids) - 1 - sample.prefix  # the turn's rows only, either way
    with torch.no_grad():
        (whole,) = model.hidden_batch([torch.as_tensor(sample.ids[:-1])], [model.new_state()])
    assert torch.allclose(rows, whole[sample.prefix :], atol=1e-4)
    (rows * torch.randn(rows.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    only_prompt = np.setdiff1d(sample.ids[: sample.prefix], sample.ids[sample.prefix :])
    reached = params["token_embd.weight"].grad[only_prompt].abs().sum(1) > 0
    assert len(only_prompt) > 50
    assert reached.float().mean() > 0.9 if autograd else not reached.any()


def around_arguments(book: str, tokenizer: Tokenizer, heldout: bool) -> set[int]:
    """The ids of rendered training (or held-out) samples (every shape, template and mode, the
    clients' tools too, composed greetings) up to the end of the call, but for the request's argument
    (with what follows it) and the call's value."""
    requests = tool_requests(book, 120, 0, heldout=heldout, unquoted=0.5)
    samples = tool_samples(
        book, tokenizer, 120, 0, 0.5, heldout=heldout, greetings=0 if heldout else 0.3, reasoning=True,
        client_tools=0.5, composed_greetings=True, unquoted=0.5,
    )  # fmt: skip
    user, assistant, eos = (tokenizer.token_id(t) for t in (USER, ASSISTANT, EOS))
    openers = set(quote_openers(tokenizer))
    ids: set[int] = set()
    for request, sample in zip(requests, samples, strict=True):
        got = sample.ids.tolist()
        start, end = sample.argument
        if start == end:  # a greeting: no argument, no tool result
            ids.update(got)
            continue
        asked, reply = got.index(user) + 1, got.index(assistant)
        if request.quoted:  # up to the opening quote or backtick
            head = max(i for i in range(asked, reply) if got[i] in openers) + 1
        else:
            argument = tokenizer.encode(" " + request.argument)
            head = next(i for i in range(asked, reply) if got[i : i + len(argument)] == argument)
        ids.update(got[:head] + got[reply:start] + got[end : got.index(eos, end) + 1])
    return ids


@pytest.mark.parametrize("which", [TwinSet.FREE, TwinSet.ARGUMENTS])
@pytest.mark.parametrize("heldout", [False, True], ids=["training", "held-out"])
def test_no_twin_holds_a_piece_of_the_text_around_an_argument(
    heldout: bool, which: TwinSet, tokenizer: Tokenizer, book: str
) -> None:
    """Held-out requests too: their templates put the training ones' words after a space (`please
    read`). (Not the held-out greetings: `buonasera`, `hey there` have words no training text has.)"""
    around = around_arguments(book, tokenizer, heldout)
    tied = {i for pair in twin_set(tokenizer, TwinSet.ALL, book) for i in pair}
    assert len(around & tied) > 100  # all twins: ` read` and `read`, ` file`, ` for`...
    kept = {i for pair in twin_set(tokenizer, which, book) for i in pair}
    assert not around & kept, [tokenizer.decode([i]) for i in around & kept]


@pytest.mark.parametrize("which", [TwinSet.FREE, TwinSet.ARGUMENTS])
@pytest.mark.parametrize("heldout", [False, True], ids=["training", "held-out"])
def test_most_bare_arguments_keep_their_twin(heldout: bool, which: TwinSet, tokenizer: Tokenizer, book: str) -> None:
    """The call's first id (`bare_value`) is still the kept twin of the request's first argument
    token for most bare requests (the filter drops ` con`, ` per`, ` la`... that the templates and
    greetings hold), held-out ones too, though `TwinSet.ARGUMENTS` keeps only the pairs that open a
    training argument (1,118 of 12,290)."""
    twins = dict(twin_set(tokenizer, which, book))
    requests = tool_requests(book, 300, 5, heldout=heldout, unquoted=1.0)
    paired = sum(
        twins.get(tokenizer.encode(" " + r.argument)[0]) == bare_value(r.argument, tokenizer)[0] for r in requests
    )
    assert paired >= 0.6 * len(requests), paired
