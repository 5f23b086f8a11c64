"""Batch invariance of the reference backend (issue 37): a sequence's logits and KV are the same bits
whether it runs alone or beside other sequences, in one prefill chunk or in pieces, by decode steps
or inside a chunk. Rounding-level differences between those paths are enough to flip a greedy token
where the router's or the indexer's top-k, or the two best tokens, are nearly tied, so a server's
greedy reply would depend on what else it was running.

The bundled nano model with QAT on, random token ids: the companions are shorter and longer than
the sequence (so its decode-step keys are padded out to theirs), the pieces end inside and on ratio-4
windows, and the prompt is long enough that the window ring has wrapped.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.loader import open_model
from dwarfstar.model.numerics import elementwise

VOCAB = 129280
IDS = torch.randint(3, VOCAB, (1100,), generator=torch.Generator().manual_seed(37)).tolist()
PROMPT, SHORT, LONG = IDS[:300], IDS[300:337], IDS[337:1100]  # LONG: more compressed rows than PROMPT
PIECES = [1, 64, 131, 256, 297, 299]  # where a split prefill cuts PROMPT (the last pieces are 2 and 1 tokens)
STEPS = 4


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(open_model(default_model_path()), kv_slots=4)


@pytest.fixture(scope="module")
def alone(model):
    """PROMPT in one chunk (logits at every position), then STEPS greedy decode steps, all alone."""
    state = model.new_state()
    logits = [model.forward(PROMPT, state)]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(state.logits.argmax()))
        logits.append(model.forward([tokens[-1]], state))
    return torch.cat(logits), tokens, state


def same_state(model, got, want) -> None:
    assert got.pos == want.pos and got.tokens == want.tokens
    for il in range(model.args.n_layers):
        mine, theirs = got.host_parts(il), want.host_parts(il)
        assert mine.keys() == theirs.keys()
        for name in theirs:
            assert np.array_equal(mine[name], theirs[name]), f"layer {il}, {name}"


def test_a_sequence_is_the_same_beside_others_as_alone(model, alone) -> None:
    want, tokens, alone_state = alone
    state, short, long = model.new_state(), model.new_state(), model.new_state()
    model.forward(LONG, long, all_logits=False)
    got = [model.forward_batch([PROMPT, SHORT], [state, short], all_logits=True)[0]]  # a batched prefill
    for token in tokens:  # batched decode steps beside a shorter and a longer sequence
        step = [token, int(short.logits.argmax()), int(long.logits.argmax())]
        got.append(model.forward_batch([[t] for t in step], [state, short, long])[0])
    assert torch.equal(torch.cat(got), want)
    same_state(model, state, alone_state)


def test_a_sequence_is_the_same_in_pieces_as_in_one_chunk(model, alone) -> None:
    want, tokens, alone_state = alone
    state, got, start = model.new_state(), [], 0
    for end in [*PIECES, len(PROMPT)]:  # the last tokens one by one: decode steps over a prompt
        got.append(model.forward(PROMPT[start:end], state))
        start = end
    got.append(model.forward(tokens, state))  # the replies' tokens in one chunk
    assert torch.equal(torch.cat(got), want)
    same_state(model, state, alone_state)


def test_linear_rows_do_not_depend_on_their_company() -> None:
    g = torch.Generator().manual_seed(0)
    for k, n in [(96, 64), (384, 24), (96, 2020), (128, 96)]:
        x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g)
        full = ops.linear(x, w)
        for m in [1, 2, 3, 5, 8, 15, 16, 17, 33, 299]:
            assert torch.equal(ops.linear(x[:m], w), full[:m]), (k, n, m)
            assert torch.equal(ops.linear(x[-m:], w), full[-m:]), (k, n, m)


def test_elementwise_values_do_not_depend_on_where_they_sit() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 8
    for fn in (torch.sigmoid, torch.nn.functional.silu, torch.nn.functional.softplus, torch.exp):
        whole = elementwise(fn, x)
        assert torch.equal(whole, torch.cat([elementwise(fn, x[i : i + 1]) for i in range(1000)]))
        assert torch.equal(elementwise(fn, x[3:40].view(37, 1)).flatten(), whole[3:40])


def test_attention_rows_ignore_their_padding_and_their_batch() -> None:
    """A row's output over its own keys equals its output with more masked keys after them (whole
    blocks of them, and garbage, as uninitialised padding may be) and beside other rows."""
    g = torch.Generator().manual_seed(2)
    heads, dim, rows = 4, 64, 5
    q, sinks = torch.randn(rows, heads, dim, generator=g), torch.randn(heads, generator=g)
    window = (torch.randn(rows, 64, dim, generator=g), torch.rand(rows, 64, generator=g) > 0.2)
    keys, visible = torch.randn(rows, 700, dim, generator=g), torch.rand(rows, 700, generator=g) > 0.5
    counts = [1, 64, 130, 500, 700]  # each row's own compressed keys
    visible &= torch.arange(700)[None, :] < torch.tensor(counts)[:, None]
    keys = torch.where(visible[..., None], keys, torch.nan)  # what a row does not see may be anything
    out, weights = ops.attention_rows(q, [window, (keys, visible)], sinks)
    for i, n in enumerate(counts):
        own = [(window[0][i : i + 1], window[1][i : i + 1]), (keys[i : i + 1, :n], visible[i : i + 1, :n])]
        mine, parts = ops.attention_rows(q[i : i + 1], own, sinks)
        assert torch.equal(mine, out[i : i + 1]), n
        assert torch.equal(parts[1], weights[1][i : i + 1, :, :n]) and not weights[1][i, :, n:].any()


def test_the_indexer_breaks_ties_towards_the_lower_row() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 5.0, 3.0, 0.0]])
    visible = torch.tensor([[True] * 5 + [False] + [True] * 2])
    picked = ops.top_k_visible(scores, visible, 3)
    assert picked.nonzero()[:, 1].tolist() == [1, 2, 4]  # the 5.0 is not visible; of the 3.0s, the first three
    more = torch.cat((scores, torch.full((1, 60), 3.0)), 1), torch.cat((visible, torch.zeros(1, 60, dtype=bool)), 1)
    assert torch.equal(ops.top_k_visible(*more, 3)[:, :8], picked)  # padding keys never win a tie
