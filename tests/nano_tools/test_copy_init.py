"""The copy circuit planted in the nano model's initial weights (dwarfstar/train/induction.py): before
any training, layer 0's head 0 attends to the previous token and layer 1's head 0 to the token after
the earlier occurrence of the current one, in the nano shape and the 256-wide twin's; plain random
weights attend to neither. With markers and openers, layer 1's head 1 attends from a marker to the
token after an opener (where a copied argument starts)."""

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


def attention_of(
    args: ModelArgs, monkeypatch: pytest.MonkeyPatch, markers: tuple[int, ...] | None
) -> Callable[[np.ndarray], list[torch.Tensor]]:
    """A function from tokens to each layer's attention probabilities [T, heads, window keys], over a
    model at its initialisation: random weights (`markers` None), or the circuit planted (with the
    finding head when `markers` are given). Key i is position i while the tokens fit in the window."""
    params = init_params(args, seed=0)
    if markers is not None:
        plant_copy_circuit(params, args, seed=0, markers=markers, openers=OPENERS)
    model = ReferenceModel.from_weights(args, ParamWeights(params), qat=False)
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


def attention_mass(args: ModelArgs, planted: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    """Mean attention of layer 0's head 0 on the previous token and of layer 1's head 0 on the
    induction target, over the repeat of four copy sequences."""
    attention = attention_of(args, monkeypatch, markers=() if planted else None)
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


@pytest.mark.parametrize("args", [NANO, TWIN], ids=["nano", "twin"])
def test_planted_heads_attend_to_the_previous_token_and_the_induction_target(
    args: ModelArgs, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous, induction = attention_mass(args, planted=True, monkeypatch=monkeypatch)
    assert previous > 0.8 and induction > 0.8, (previous, induction)


def test_random_weights_attend_to_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    previous, induction = attention_mass(NANO, planted=False, monkeypatch=monkeypatch)
    assert previous < 0.2 and induction < 0.2, (previous, induction)


def finding_mass(args: ModelArgs, markers: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> float:
    """Mean attention of layer 1's head 1 on the token after an opener, from the marker that follows
    the opener's text some 30 tokens later."""
    attention = attention_of(args, monkeypatch, markers=markers)
    rng = np.random.default_rng(2)
    at_marker = []
    for opener in OPENERS * 2:
        before, argument, after = (rng.integers(8, VOCAB, size=n) for n in (10, 5, 30))
        probs = attention(np.concatenate(([0], before, [opener], argument, after, [MARKER])))
        start = 1 + len(before) + 1  # the argument's first token
        finding = probs[1][:, 1]  # [T, keys] of layer 1's head 1
        at_marker.append(float(finding[-1, start]))
    return float(np.mean(at_marker))


@pytest.mark.parametrize("args", [NANO, TWIN], ids=["nano", "twin"])
def test_planted_finding_head_attends_from_the_marker_to_the_token_after_the_opener(
    args: ModelArgs, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert finding_mass(args, (MARKER,), monkeypatch) > 0.6


def test_without_markers_head_1_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert finding_mass(NANO, (), monkeypatch) < 0.2
