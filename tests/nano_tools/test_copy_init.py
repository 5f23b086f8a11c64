"""The copy circuit planted in the nano model's initial weights (dwarfstar/train/induction.py): before
any training, layer 0's head 0 attends to the previous token and layer 1's head 0 to the token after
the earlier occurrence of the current one, in the nano shape and the 256-wide twin's; plain random
weights attend to neither. With markers and openers, layer 1's head 1 attends from a marker to the
token after an opener (where a copied argument starts). With leads and twins too, head 2 attends from
a marker to the token after a lead (a bare argument's start, ` X`) and writes its twin `X`, and the
other heads still do their work."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.config import ModelArgs, flash_compress_ratios
from dwarfstar.train.induction import plant_copy_circuit
from dwarfstar.train.params import ParamWeights, init_params

VOCAB = 600
RUN = 20  # a run of random tokens, then the same run again: the repeat is RUN tokens back
NANO = ModelArgs(
    n_layers=6, dim=96, vocab_size=VOCAB, n_heads=4, head_dim=64, rope_dim=16, q_lora_rank=64, o_groups=2,
    o_lora_rank=64, n_routed_experts=8, n_activated_experts=2, moe_inter_dim=128, n_hash_layers=2, window=64,
    compress_ratios=flash_compress_ratios(6), index_n_heads=4, index_head_dim=32, index_topk=16,
)  # fmt: skip
TWIN = NANO.with_(dim=256, moe_inter_dim=256)
MARKER, OPENERS = 5, (6, 7)  # stand-ins for a call's `">` and a request's ` `` ` and ` "`
LEADS = tuple(range(8, 23))  # for the bare requests' template words (` file`, ` for`, `erca`...)
TWINS = tuple((i, i + 150) for i in range(100, 250))  # (` X`, `X`)


def planted_model(
    args: ModelArgs,
    markers: tuple[int, ...] | None,
    leads: tuple[int, ...] = (),
    twins: tuple[tuple[int, int], ...] = (),
) -> ReferenceModel:
    """The model at its initialisation: random weights (`markers` None), or the circuit planted (with
    the finding head when `markers` are given, and the bare one with `leads`)."""
    params = init_params(args, seed=0)
    if markers is not None:
        plant_copy_circuit(params, args, seed=0, markers=markers, openers=OPENERS, leads=leads, twins=twins)
    return ReferenceModel.from_weights(args, ParamWeights(params), qat=False)


def attention_of(
    args: ModelArgs, monkeypatch: pytest.MonkeyPatch, markers: tuple[int, ...] | None, bare: bool = False
) -> Callable[[np.ndarray], list[torch.Tensor]]:
    """A function from tokens to each layer's attention probabilities [T, heads, window keys] over
    `planted_model`. Key i is position i while the tokens fit in the window."""
    model = planted_model(args, markers, *((LEADS, TWINS) if bare else ()))
    probs: list[torch.Tensor] = []
    attend = ops.attention_rows

    def spy(q: torch.Tensor, parts: list, sinks: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out, weights = attend(q, parts, sinks)
        probs.append(weights[0])  # the window's part, slot p holding position p
        return out, weights

    monkeypatch.setattr(ops, "attention_rows", spy)

    def run(tokens: np.ndarray) -> list[torch.Tensor]:
        probs.clear()
        with torch.no_grad():
            model.hidden_batch([torch.as_tensor(tokens)], [model.new_state()])
        return list(probs)

    return run


def attention_mass(
    args: ModelArgs, planted: bool, monkeypatch: pytest.MonkeyPatch, bare: bool = False
) -> tuple[float, float]:
    """Mean attention of layer 0's head 0 on the previous token and of layer 1's head 0 on the
    induction target, over the repeat of four copy sequences."""
    markers = ((MARKER,) if bare else ()) if planted else None
    attention = attention_of(args, monkeypatch, markers=markers, bare=bare)
    rng = np.random.default_rng(1)
    previous, induction = [], []
    for _ in range(4):
        run = rng.integers(2, VOCAB, size=RUN)
        probs = attention(np.concatenate(([0], run, run)))
        first, second = probs[0][:, 0], probs[1][:, 0]  # [T, keys] of head 0
        for t in range(RUN + 2, 1 + 2 * RUN):  # token t repeats token t - RUN
            previous.append(float(first[t, t - 1]))
            induction.append(float(second[t, t - RUN + 1]))
    return float(np.mean(previous)), float(np.mean(induction))


@pytest.mark.parametrize("bare", [False, True], ids=["", "bare"])
@pytest.mark.parametrize("args", [NANO, TWIN], ids=["nano", "twin"])
def test_planted_heads_attend_to_the_previous_token_and_the_induction_target(
    args: ModelArgs, bare: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous, induction = attention_mass(args, planted=True, monkeypatch=monkeypatch, bare=bare)
    assert previous > 0.8 and induction > 0.8, (previous, induction)


def test_random_weights_attend_to_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    previous, induction = attention_mass(NANO, planted=False, monkeypatch=monkeypatch)
    assert previous < 0.2 and induction < 0.2, (previous, induction)


def finding_mass(
    args: ModelArgs, markers: tuple[int, ...], monkeypatch: pytest.MonkeyPatch, bare: bool = False, head: int = 1
) -> float:
    """Mean attention of layer 1's `head` on the token after an opener (head 1) or a lead (head 2),
    from the marker that follows the request some 30 tokens later."""
    attention = attention_of(args, monkeypatch, markers=markers, bare=bare)
    rng = np.random.default_rng(2)
    at_marker = []
    for opener in OPENERS * 2 if head == 1 else LEADS[::3]:
        before, argument, after = (rng.integers(LEADS[-1] + 1, VOCAB, size=n) for n in (10, 5, 30))
        probs = attention(np.concatenate(([0], before, [opener], argument, after, [MARKER])))
        start = 1 + len(before) + 1  # the argument's first token
        finding = probs[1][:, head]  # [T, keys] of layer 1's head
        at_marker.append(float(finding[-1, start]))
    return float(np.mean(at_marker))


@pytest.mark.parametrize("bare", [False, True], ids=["", "bare"])
@pytest.mark.parametrize("args", [NANO, TWIN], ids=["nano", "twin"])
def test_planted_finding_head_attends_from_the_marker_to_the_token_after_the_opener(
    args: ModelArgs, bare: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert finding_mass(args, (MARKER,), monkeypatch, bare=bare) > 0.6


def test_without_markers_head_1_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert finding_mass(NANO, (), monkeypatch) < 0.2


@pytest.mark.parametrize("args", [NANO, TWIN], ids=["nano", "twin"])
def test_planted_bare_head_attends_from_the_marker_to_the_token_after_a_lead(
    args: ModelArgs, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert finding_mass(args, (MARKER,), monkeypatch, bare=True, head=2) > 0.8
    assert finding_mass(args, (MARKER,), monkeypatch, bare=False, head=2) < 0.2


def bare_head_picks(args: ModelArgs, twins: bool) -> tuple[int, int]:
    """Over 20 bare requests (a lead, then ` X` and three more tokens, 30 tokens, the marker): how
    often layer 1's head 2 alone, read through the output head, ranks `X` first, and how often
    above ` X`."""
    model = planted_model(args, (MARKER,), LEADS, TWINS if twins else ())
    heads: list[torch.Tensor] = []
    output = model.ops.attn_output

    def spy(il: int, o: torch.Tensor, batch: object) -> torch.Tensor:
        if il == 1:
            heads.append(o[-1].reshape(args.n_heads, -1).clone())
        return output(il, o, batch)

    model.ops.attn_output = spy
    rng = np.random.default_rng(3)
    first = above = 0
    for k in range(20):
        spaced, twin = TWINS[7 * k]
        rest = rng.integers(TWINS[-1][1] + 1, VOCAB, size=33)
        tokens = np.concatenate(([0], rest[:10], [LEADS[k % len(LEADS)], spaced], rest[10:], [MARKER]))
        heads.clear()
        with torch.no_grad():
            model.hidden_batch([torch.as_tensor(tokens)], [model.new_state()])
            alone = torch.zeros_like(heads[0])
            alone[2] = heads[0][2]
            logits = model.ops.logits(output(1, alone.reshape(1, -1), None), None)[0]
        first += int(logits.argmax()) == twin
        above += int(logits[twin] > logits[spaced])
    return first, above


@pytest.mark.parametrize("args", [NANO, TWIN], ids=["nano", "twin"])
def test_planted_bare_head_writes_the_twin_of_the_token_it_finds(args: ModelArgs) -> None:
    """With twin codes, what head 2 copies from ` X` raises `X` above every other token in most
    requests and above ` X` in all; without them, it raises ` X` itself."""
    first, above = bare_head_picks(args, twins=True)
    assert first >= 12 and above == 20, (first, above)
    first, above = bare_head_picks(args, twins=False)
    assert first == 0 and above == 0, (first, above)
