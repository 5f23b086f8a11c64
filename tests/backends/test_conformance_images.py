"""Image blocks on every backend against the torch reference (issue 34): the spans' rows in place of the
embedding, routing by the image bias, Vision-Exp's bidirectional window inside START..END and V4.1's
causal blocks, in one prefill pass and split across passes (a block wholly in the later one).

The tiny model's raw window is 8, so a block longer than that reads rows its causal window never sees
(both ways); the prompt runs past position 20, so the indexer chooses among the compressed rows, which
stay causal for image queries. Tolerances are the suite's (`conformance.assert_matches_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conformance import PROMPT, REFERENCE, assert_matches_reference, load

from dwarfstar.backends.protocol import Backend
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.image_spans import ImageSpan, content_ids
from dwarfstar.model.synthetic import TINY


@dataclass(frozen=True)
class Block:
    """An image block: its ids and rows, and START..END within it (None: a causal, V4.1-style block)."""

    ids: list[int]
    rows: torch.Tensor
    attend: tuple[int, int] | None


def block(length: int, attend: tuple[int, int] | None, seed: int) -> Block:
    ids = content_ids(seed.to_bytes(4, "little"), length, TINY.vocab_size)
    return Block(ids, torch.randn(length, TINY.dim, generator=torch.Generator().manual_seed(seed)), attend)


# Vision-Exp: two leading pads (outside START..END, causal), START, 12 body positions, END
VISION_EXP = block(16, (2, 15), seed=1)
V41 = block(6, None, seed=2)  # V4.1: the whole block causal
PROMPTS = {
    "one-block": (PROMPT[:6], VISION_EXP, PROMPT[6:14]),
    "two-blocks": (PROMPT[:6], VISION_EXP, PROMPT[6:11], V41, PROMPT[11:16]),
    # the causal block in the first pass, the Vision-Exp block wholly in the second, whose window rows
    # start in the ring (past position 8)
    "split": (PROMPT[:4], V41, PROMPT[4:9], VISION_EXP, PROMPT[9:13]),
}
SPLIT_AT = 13  # 4 text, 6 image, 3 text | 2 text, 16 image, 4 text
DECODE = PROMPT[13:15]  # decode steps after the split prefill


def layout(parts) -> tuple[list[int], list[ImageSpan]]:
    """The tokens of text lists and blocks in order, and the blocks' spans."""
    tokens: list[int] = []
    spans = []
    for part in parts:
        if isinstance(part, Block):
            spans.append(ImageSpan(len(tokens), part.rows, part.attend))
            part = part.ids
        tokens += part
    return tokens, spans


def passes(parts, cut: int) -> list[tuple[list[int], list[ImageSpan]]]:
    """The prompt as two calls split at token `cut`, each with its own spans (none crosses the cut)."""
    tokens, spans = layout(parts)
    assert all(s.stop <= cut or s.offset >= cut for s in spans)
    first = [s for s in spans if s.stop <= cut]
    second = [ImageSpan(s.offset - cut, s.rows, s.attend) for s in spans if s.offset >= cut]
    return [(tokens[:cut], first), (tokens[cut:], second)]


def image_biases() -> dict[int, torch.Tensor]:
    """Random image router biases, large enough that image rows route differently from text rows."""
    gen = torch.Generator().manual_seed(11)
    return {il: torch.randn(TINY.n_routed_experts, generator=gen) for il in range(TINY.n_layers)}


def with_biases(backend: Backend) -> Backend:
    backend.attach_image_biases(image_biases())  # the same values each time: attaching again changes nothing
    return backend


def prefill(backend: Backend, calls, state=None) -> torch.Tensor:
    """Every position's logits over the calls, one state."""
    state = backend.new_state() if state is None else state
    return torch.cat([backend.forward_batch([t], [state], all_logits=True, images=[s])[0].cpu() for t, s in calls])


@pytest.fixture(scope="module")
def reference_images(loaded):
    """reference_images(name, qat) -> the reference's logits over PROMPTS[name], one pass."""
    cache = {}

    def get(name: str, qat: bool) -> torch.Tensor:
        if (name, qat) not in cache:
            cache[name, qat] = prefill(with_biases(loaded(REFERENCE, qat)), [layout(PROMPTS[name])])
        return cache[name, qat]

    return get


@pytest.mark.parametrize("qat", [False, True], ids=["qat-off", "qat-on"])
@pytest.mark.parametrize("name", ["one-block", "two-blocks"])
def test_image_blocks_match_reference(kind, loaded, reference_images, name, qat):
    backend = with_biases(loaded(kind, qat))
    got = prefill(backend, [layout(PROMPTS[name])])
    assert_matches_reference(reference_images(name, qat), got, qat, f"a prefill with image blocks ({name})")


def test_blocks_split_across_passes_match_reference(kind, loaded, reference_images):
    """A causal block in the first pass, a Vision-Exp block wholly in the second (its window rows
    partly in the ring), then decode steps, which read the ring the second pass left."""
    backend, reference = with_biases(loaded(kind, False)), with_biases(loaded(REFERENCE, False))
    state = backend.new_state()
    got = prefill(backend, passes(PROMPTS["split"], SPLIT_AT), state)
    assert_matches_reference(reference_images("split", False), got, False, "prefill in two passes")
    want_state = reference.new_state()
    prefill(reference, [layout(PROMPTS["split"])], want_state)
    for token in DECODE:
        want = reference.forward([token], want_state, all_logits=False)
        got = backend.forward([token], state, all_logits=False)
        assert_matches_reference(want, got.cpu(), False, f"decode step at {state.pos - 1}")


def test_text_after_biases_keeps_its_bits(kind, loaded):
    """Attaching image biases changes nothing for a call without spans."""
    backend = loaded(kind, False)
    plain = prefill(backend, [(PROMPT[:10], [])])
    assert torch.equal(prefill(with_biases(backend), [(PROMPT[:10], [])]), plain)


def test_spans_need_the_image_biases(kind, model_path):
    """A backend given no image router biases refuses a call with spans before any state changes."""
    backend = load(kind, model_path, qat=False)
    tokens, spans = layout(PROMPTS["one-block"])
    state = backend.new_state()
    with pytest.raises(DwarfStarError, match="image router biases"):
        backend.forward_batch([tokens], [state], images=[spans])
    assert state.pos == 0
