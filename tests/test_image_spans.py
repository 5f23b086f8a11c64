"""Image spans in the language model (issue 34; sources: RELEASES_2026.md) on the reference backend, tiny model:
the span rows replace the embedding exactly, image rows route by `bias_vl` (hash layers too), the
window branch is bidirectional inside START..END and causal outside it, the compressed branch stays
causal, text-only calls keep their bits, and bad spans or a model without the image biases get clear errors.
Every backend against this one: tests/backends/test_conformance_images.py."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.image_spans import IMAGE_IDS, REACH, ImageSpan, content_ids
from dwarfstar.model.numerics import route
from dwarfstar.model.synthetic import TINY
from dwarfstar.prompt.image_layout import ExpToken

VOCAB = TINY.vocab_size
START, PAD, IMAGE, NEWLINE, END = (VOCAB + t for t in ExpToken)
TEXT = torch.randint(3, 120000, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def block(n_pad: int, body: int, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """A Vision-Exp-like block: n_pad leading PADs, START, `body` IMAGE/NEWLINE positions, END; random rows."""
    ids = [PAD] * n_pad + [START] + [IMAGE if i % 4 != 3 else NEWLINE for i in range(body)] + [END]
    rows = torch.randn(len(ids), TINY.dim, generator=torch.Generator().manual_seed(seed))
    return ids, rows


def run(image_model: ReferenceModel, tokens: list[int], spans=None) -> torch.Tensor:
    state = image_model.new_state()
    return image_model.forward_batch([tokens], [state], all_logits=True, images=None if spans is None else [spans])[0]


def test_text_calls_keep_their_bits(image_model, tiny_open):
    """No spans: the same logits with or without image biases attached, with images None or empty; a text
    sequence batched with one that carries a span gets the bits it gets alone."""
    plain = ReferenceModel(tiny_open)
    want = run(plain, TEXT)
    assert torch.equal(run(image_model, TEXT), want)
    assert torch.equal(run(image_model, TEXT, []), want)
    ids, rows = block(2, 9)
    other = TEXT[:5] + ids + TEXT[5:12]
    span = ImageSpan(5, rows, (2, len(ids) - 1))
    states = [image_model.new_state(), image_model.new_state()]
    got = image_model.forward_batch([TEXT, other], states, all_logits=True, images=[[], [span]])
    assert torch.equal(got[0], want)


def test_span_rows_are_an_exact_override(image_model, tiny_open):
    """A one-row span holding token t's embedding, with bias_vl steering every layer to t's experts
    (the text bias, or the hash table's pick), gives the logits of the plain call with t."""
    at, t = 17, TEXT[17]
    ops = image_model.ops
    biases = {}
    for il in range(TINY.n_layers):
        layer = ops.layers[il]
        if layer.tid2eid is None:
            biases[il] = layer.bias.clone()
        else:  # large enough that top-k picks the table's experts for t whatever the scores
            biases[il] = torch.zeros(TINY.n_routed_experts).index_fill_(0, layer.tid2eid[t], 1e3)
    m = ReferenceModel(tiny_open)
    m.attach_image_biases(biases)
    tokens = TEXT[:at] + [IMAGE] + TEXT[at + 1 :]
    span = ImageSpan(at, ops.embedding[[t]].clone(), (0, 0))
    assert torch.equal(run(m, tokens, [span]), run(m, TEXT))


def test_image_rows_route_by_bias_vl(tiny_open):
    """bias_vl forcing experts {5, 6}: every image row picks them in every layer, hash layers included;
    the text rows before the block pick what they pick in a plain call, those after it in a hash layer
    their table's experts."""
    m = ReferenceModel(tiny_open)
    forced = torch.zeros(TINY.n_routed_experts).index_fill_(0, torch.tensor([5, 6]), 1e3)
    m.attach_image_biases({il: forced for il in range(TINY.n_layers)})
    seen: dict[int, torch.Tensor] = {}
    m.ops.route_observer = lambda il, ids: seen.__setitem__(il, ids.clone())
    ids, rows = block(1, 6)
    tokens = TEXT[:10] + ids + TEXT[10:20]
    run(m, tokens, [ImageSpan(10, rows, (1, len(ids) - 1))])
    image = seen.copy()
    run(m, TEXT[:10])
    assert set(image) == set(range(TINY.n_layers))
    after = torch.tensor(TEXT[10:20])
    for il, chosen in image.items():
        assert chosen[10 : 10 + len(ids)].sort(-1).values.eq(torch.tensor([5, 6])).all(), il
        assert torch.equal(chosen[:10], seen[il]), il
        table = m.ops.layers[il].tid2eid
        if table is not None:
            assert torch.equal(chosen[10 + len(ids) :], table[after]), il


def test_route_weights_are_unbiased_scores():
    """`route` of image rows: selected by score + bias_vl, weighted by the unbiased scores renormalised
    times route_scale, in a hash layer (`fixed`) as in a biased one."""
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    image = torch.tensor([False, True, True, False])
    bias_vl = torch.zeros(8).index_fill_(0, torch.tensor([0, 7]), 50.0)
    fixed = torch.tensor([[1, 2]] * 4)
    scores = torch.nn.functional.softplus(logits).sqrt()
    for bias, table in ((torch.zeros(8), None), (None, fixed)):
        ids, weights = route(logits, 2, 1.5, bias, table, image, bias_vl)
        assert ids[image].sort(-1).values.eq(torch.tensor([0, 7])).all()
        if table is not None:
            assert torch.equal(ids[~image], fixed[~image])
        want = scores.gather(1, ids)
        assert torch.allclose(weights, want / want.sum(-1, keepdim=True) * 1.5, rtol=0, atol=1e-6)


def test_window_is_bidirectional_inside_the_span_only(image_model):
    """Changing the span's END row moves START's logits (it sees ahead in the span, beyond the window of
    8) but neither the text before the block nor its leading PADs (causal, outside START..END)."""
    ids, rows = block(2, 12)
    assert len(ids) > TINY.window + 3
    tokens = TEXT[:9] + ids + TEXT[9:15]
    changed = rows.clone()
    changed[-1] += 1.0
    attend = (2, len(ids) - 1)
    a = run(image_model, tokens, [ImageSpan(9, rows, attend)])
    b = run(image_model, tokens, [ImageSpan(9, changed, attend)])
    start = 9 + 2
    assert torch.equal(a[:start], b[:start])  # the text before and the PADs
    assert not torch.allclose(a[start], b[start], rtol=0, atol=1e-4)
    causal = run(image_model, tokens, [ImageSpan(9, rows, None)])
    assert torch.equal(causal[:start], a[:start])
    assert not torch.allclose(causal[start], a[start], rtol=0, atol=1e-4)


def test_compressed_rows_stay_causal_for_span_queries(image_model):
    """The indexer's scores and the attention mass on the compressed rows (ratio-4 layers) give a span
    query no row its position has not completed."""
    ids, rows = block(3, 18)
    tokens = TEXT[:20] + ids + TEXT[20:24]
    first, last = 20 + 3, 20 + len(ids) - 1
    seen = []
    image_model.ops.indexer_observer = lambda il, mass, scores: seen.append((il, mass.clone(), scores.clone()))
    try:
        run(image_model, tokens, [ImageSpan(20, rows, (3, len(ids) - 1))])
    finally:
        image_model.ops.indexer_observer = None
    assert seen
    for il, mass, scores in seen:
        ratio = TINY.compress_ratios[il]
        done = torch.arange(scores.shape[1])[None, :] < ((torch.arange(len(tokens)) + 1) // ratio)[:, None]
        span = slice(first, last + 1)
        assert torch.isinf(scores[span][~done[span]]).all(), il
        assert (mass[span].sum(1)[~done[span]] == 0).all(), il
        assert (mass[span].sum(1)[done[span]] > 0).any(), il  # the rows it may read, it does


def test_window_bounds_follow_the_reference_rule():
    """`window_bounds` against the Vision-Exp reference's visible window, for a span longer than the
    reach on both sides, with the real window of 128 and a tiny one."""
    length, offset, base = 900, 37, 1000
    span = ImageSpan(offset, torch.zeros(length, 4), (3, length - 1))
    for window in (128, 8):
        at, lo, hi = span.window_bounds(base, window)
        start, end = base + offset + 3, base + offset + length - 1
        assert at[0] == start and at[-1] == end
        for k in (0, 1, 200, 383, 384, 500, at.numel() - 385, at.numel() - 1):
            i = int(at[k])
            left, right = min(i - start, REACH - 1), min(end - i, REACH)
            first = max(0, i - (window - 1) - max(0, left - (window - 1)))
            keys = [first + t for t in range(window + REACH) if first + t <= i + right]
            assert (int(lo[k]), int(hi[k])) == (keys[0], keys[-1]), (window, k)


def test_any_ids_past_the_vocabulary_mark_an_image_position(image_model):
    """The ids at a span's positions only say "image": content ids (and ids up to IMAGE_IDS - 1) give the
    sentinels' logits bit for bit; outside a span the same ids are refused."""
    ids, rows = block(1, 7)
    span = ImageSpan(6, rows, (1, len(ids) - 1))
    want = run(image_model, TEXT[:6] + ids + TEXT[6:14], [span])
    for other in (content_ids(b"some image", len(ids), VOCAB), [IMAGE_IDS - 1 - i for i in range(len(ids))]):
        assert other != ids and min(other) >= VOCAB
        assert torch.equal(run(image_model, TEXT[:6] + other + TEXT[6:14], [span]), want)
    with pytest.raises(DwarfStarError, match="outside the vocabulary"):
        run(image_model, TEXT[:6] + other + TEXT[6:14] + [other[0]], [span])


def test_content_ids_identify_the_image_and_the_block():
    """content_ids: deterministic, in [vocab, IMAGE_IDS), distinct within a block; another digest or
    another length gives ids that differ at every index (no shared prefix)."""
    a = content_ids(b"\x01" * 32, 600, VOCAB)
    assert a == content_ids(b"\x01" * 32, 600, VOCAB)
    assert len(set(a)) == 600 and VOCAB <= min(a) and max(a) < IMAGE_IDS
    for b in (content_ids(b"\x02" + b"\x01" * 31, 600, VOCAB), content_ids(b"\x01" * 32, 601, VOCAB)):
        assert all(x != y for x, y in zip(a, b, strict=False))
    tight = content_ids(b"x", 50, IMAGE_IDS - 50)  # as many ids as positions: a permutation of them
    assert sorted(tight) == list(range(IMAGE_IDS - 50, IMAGE_IDS))
    with pytest.raises(DwarfStarError, match="more positions than image ids"):
        content_ids(b"x", 51, IMAGE_IDS - 50)


def test_bad_spans_are_refused_before_any_state_changes(image_model, tiny_open):
    ids, rows = block(1, 5)
    tokens = TEXT[:4] + ids + TEXT[4:8]
    state = image_model.new_state()

    def refused(tokens, spans, match, on=image_model):
        with pytest.raises(DwarfStarError, match=match):
            on.forward_batch([tokens], [state], images=[spans])
        assert state.pos == 0

    refused(tokens, [], "outside the vocabulary")  # sentinels with no span
    with pytest.raises(DwarfStarError, match="outside the vocabulary"):
        image_model.hidden_batch([tokens], [state], images=[[]])
    refused(tokens, [ImageSpan(4, rows[:-1], (1, len(ids) - 2))], "outside the vocabulary")  # END outside it
    refused(tokens[: 4 + len(ids) - 1], [ImageSpan(4, rows, None)], "inside the call")  # crosses the call's end
    text_inside = tokens[:5] + [TEXT[0]] + tokens[6:]
    refused(text_inside, [ImageSpan(4, rows, None)], "not an image id")
    too_far = tokens[:5] + [IMAGE_IDS] + tokens[6:]  # past what a saved state's u32 tokens keep
    refused(too_far, [ImageSpan(4, rows, None)], "not an image id")
    refused(tokens, [ImageSpan(4, rows[:, :8], None)], "hidden size")
    refused(tokens, [ImageSpan(4, rows, (1, len(ids)))], "START..END")
    refused(tokens, [ImageSpan(4, rows, None)], "image router biases", on=ReferenceModel(tiny_open))
    with pytest.raises(DwarfStarError, match="no image router bias"):
        ReferenceModel(tiny_open).attach_image_biases({0: torch.zeros(TINY.n_routed_experts)})
