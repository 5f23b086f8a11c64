"""Speculation over a prompt with an image block (issue 34): the speculator prefills it in the
session's passes (the block whole, its rows in the target's pass, the draft fed token 0 there), its
greedy output equals plain greedy decoding's, and the session knows the block (a cut behind it
replays it)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from dwarfstar.engine.images import expand
from dwarfstar.prompt.images import ImagePart, slot
from dwarfstar.prompt.render import render_conversation
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import load_speculation
from dwarfstar.speculative.mtp_options import MTPOptions

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def prompt(seeing):
    pixels = np.random.default_rng(5).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    image = ImagePart(buffer.getvalue(), "image/png", "test")
    rendered = render_conversation([{"role": "user", "content": slot(0) + "Renzo e Lucia"}], thinking=False)
    return expand(seeing.images, seeing.tokenizer, rendered.parts, [image])


@pytest.mark.parametrize("chunk", [16, 4096])  # passes that end before, at and after the block
def test_speculative_greedy_after_an_image_is_plain_greedy(seeing, prompt, chunk):
    ids, spans = prompt
    plain = Session(seeing.backend, ctx=512, chunk=chunk)
    plain.prefill(ids, images=spans)
    prompt_logits = plain.logits.clone()
    want = list(plain.generate(24, GREEDY, [seeing.tokenizer.eos_id]))
    speculator = load_speculation(MTPOptions(None, 2), seeing.backend, seeing.model).start(
        Session(seeing.backend, ctx=512, chunk=chunk)
    )
    assert torch.equal(speculator.prefill(ids, images=spans), prompt_logits)  # the same passes
    got = list(speculator.generate(24, GREEDY, [seeing.tokenizer.eos_id]))
    assert got == want
    assert sum(speculator.stats.accepted) > 0  # the draft followed the prompt and was right sometimes
    session = speculator.session
    assert [(s.offset, s.length) for s in session.images] == [(s.offset, s.length) for s in spans]
    cut = spans[0].stop + 3
    fresh = Session(seeing.backend, ctx=512, chunk=chunk)
    fresh.prefill(ids[:cut], images=spans)
    session.truncate(cut)  # a cut behind the block replays it from the rows the session kept
    assert torch.allclose(session.logits, fresh.logits, rtol=1e-5, atol=1e-5)
