"""The shared forward pass's entry points on every backend: layer ranges and hook points.

A pipeline stage runs `run_layers(first, last)` of the layers; steering and activation capture hook
the attention and FFN outputs. Both go through `dwarfstar.model.forward.Transformer`, so every
backend gets them; these tests check that they compose exactly on each one.
"""

from __future__ import annotations

import pytest
import torch
from conformance import PROMPT, REFERENCE, compare_logits, payload_of

from dwarfstar.model.forward import Transformer

TOKENS = PROMPT[:12]  # past the raw window of 8 and three ratio-4 rows; short for the interpreter
SPLIT = 3  # layers 0-2 (window-only and the first compressed layers) in one call, 3-5 in the next


def transformer(backend) -> Transformer:
    assert isinstance(backend, Transformer)  # every backend is the shared forward pass over its ops
    return backend


def staged_logits(model: Transformer, tokens: list[int], state, cut: int) -> torch.Tensor:
    """Logits after `tokens` computed as two stages split at layer `cut`, as a pipeline would."""
    batch = model.batch([tokens], [state])
    h = model.run_layers(model.embed(batch), batch, 0, cut)
    h = model.run_layers(h, batch, cut, model.args.n_layers)
    y, _ = model.head(h, batch, all_positions=True)
    logits = model.ops.logits(y, batch)
    model.advance(batch)
    state.logits = logits[-1].clone()  # the last stage hands the next-token logits back
    return logits


@torch.inference_mode()
def test_layer_ranges_compose_to_the_whole_forward(backend) -> None:
    model = transformer(backend)
    whole_state, staged_state = model.new_state(), model.new_state()
    whole = model.forward(TOKENS, whole_state)
    staged = staged_logits(model, TOKENS, staged_state, SPLIT)
    assert torch.equal(whole.cpu(), staged.cpu())  # the same operations in the same order: bit for bit
    assert staged_state.pos == whole_state.pos == len(TOKENS)
    assert payload_of(staged_state, backend) == payload_of(whole_state, backend)


@torch.inference_mode()
def test_hooks_see_every_sublayer_output_and_a_no_op_hook_changes_nothing(backend) -> None:
    model = transformer(backend)
    plain = model.forward(TOKENS, model.new_state())
    seen: list[tuple[str, int, tuple[int, ...]]] = []
    for point in ("attn_out", "ffn_out"):
        model.hooks[point].append(lambda il, out, batch, point=point: seen.append((point, il, tuple(out.shape))))
    try:
        hooked = model.forward(TOKENS, model.new_state())
    finally:
        for hooks in model.hooks.values():
            hooks.clear()
    assert torch.equal(plain.cpu(), hooked.cpu())
    dim, n = model.args.dim, len(TOKENS)
    assert seen == [(point, il, (n, dim)) for il in range(model.args.n_layers) for point in ("attn_out", "ffn_out")]


@pytest.mark.parametrize("point", ["attn_out", "ffn_out"])
@torch.inference_mode()
def test_a_hook_that_replaces_an_output_acts_the_same_on_every_backend(backend, loaded, point) -> None:
    """Removing a direction from layer 2's output (what steering does) moves every backend alike."""

    def remove_direction(model: Transformer) -> None:
        direction = torch.zeros(model.args.dim)
        direction[0] = 1.0

        def hook(il, out, batch):
            if il != 2:
                return None
            v = direction.to(out.device) if isinstance(out, torch.Tensor) else type(out)(direction.numpy())
            return out - (out @ v)[:, None] * v[None, :]

        model.hooks[point].append(hook)

    results = []
    for candidate in (loaded(REFERENCE, True), backend):
        model = transformer(candidate)
        plain = model.forward(TOKENS, model.new_state())
        remove_direction(model)
        try:
            results.append((plain.cpu(), model.forward(TOKENS, model.new_state()).cpu()))
        finally:
            model.hooks[point].clear()
    (ref_plain, ref_hooked), (plain, hooked) = results
    # the hook moves the model well past the tolerance below (measured: 0.11 relative, KL 2e-3), so a
    # backend that skipped it would fail
    effect = compare_logits(ref_plain, ref_hooked)
    assert effect.max_rel > 5e-2 and effect.mean_kl > 1e-4, effect
    diff = compare_logits(ref_hooked, hooked)
    assert diff.within(1e-2, 1e-5, near_ties_may_swap=True), diff  # QAT on: as in test_conformance_logits
