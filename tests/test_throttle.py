"""`--power`: the throttled backend paces the work and keeps the rest of the backend's surface."""

from __future__ import annotations

import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.loader import open_model
from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.session.throttle import throttle


def test_a_throttled_backend_keeps_batching_sampling_and_its_context(tiny_model_file) -> None:
    plain = ReferenceModel(open_model(tiny_model_file(0)), max_seq_len=64)
    paced = throttle(ReferenceModel(open_model(tiny_model_file(0)), max_seq_len=64), 50)
    assert paced.max_seq_len == 64
    blocks_before = paced.duty.busy_s
    states = {name: [b.new_state(), b.new_state()] for name, b in (("plain", plain), ("paced", paced))}
    want = plain.forward_batch([[5, 6, 7], [8]], states["plain"])
    got = paced.forward_batch([[5, 6, 7], [8]], states["paced"])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)  # sleeping never touches the numbers
    assert paced.duty.busy_s > blocks_before and paced.duty.slept_s + paced.duty.owed_s > 0
    logits = torch.stack([s.logits for s in states["paced"]])
    assert paced.sample_batch(logits, [Sampler(GREEDY), Sampler(GREEDY)]) == logits.argmax(-1).tolist()
