"""The twin pairs the bare finder's planting ties together (dwarfstar/train/copy_tokens.py), without
the pieces of the short samples' fixed text (`TwinSet.FREE`, `TwinSet.ARGUMENTS`): what a rendered
sample holds around its argument (the template's words, the tools' names, the call's markup, a
greeting and its answer) is no twin, while most bare arguments' first tokens still are."""

from __future__ import annotations

from pathlib import Path

import pytest

from dwarfstar.tokenizer.specials import ASSISTANT, EOS, USER
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.chat_data import bare_value, tool_requests, tool_samples
from dwarfstar.train.copy_tokens import TwinSet, quote_openers, twin_set
from dwarfstar.train.corpus import read_split

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
pytestmark = pytest.mark.skipif(not CORPUS.exists(), reason="needs ../shared (the corpus)")
N = 120


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), 129280)


@pytest.fixture(scope="module")
def book() -> str:
    return read_split(CORPUS).train


def around_arguments(book: str, tokenizer: Tokenizer, heldout: bool) -> set[int]:
    """The ids of rendered training (or held-out) samples (every shape, template and mode, the
    clients' tools too, composed greetings) up to the end of the call, but for the request's argument
    (with what follows it) and the call's value."""
    requests = tool_requests(book, N, 0, heldout=heldout, unquoted=0.5)
    samples = tool_samples(
        book, tokenizer, N, 0, 0.5, heldout=heldout, greetings=0 if heldout else 0.3, reasoning=True, client_tools=0.5,
        composed_greetings=True, unquoted=0.5,
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
