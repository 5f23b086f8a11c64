"""A DeepSeek V4.1 worker: one layer range of a V4.1 model (`Model41.hold`) and those layers' state of each
session, driven by its coordinator (`route41.Route41`) over the same links and messages as V4's stages.

What crosses a stage boundary is `forward_v41.Streams41`: the hc_mult streams and, since V4.1's mHC is
lagged, the mix the next layer's attention collapses them with (`encode_streams`: both as activations
of the route's width, the streams first). Each stage computes the call's positions and its Engram layers'
rows from the token ids the FORWARD carries, and its state holds every token, so the Engram hash looks
back as in one process. A stage holds every source its layers read (`forward_v41.slice_problem`), so no
compressed row or top-k crosses a boundary.

A V4.1 pass carries one sequence, and the last stage answers with its last position's logits (the
coordinator runs a call of all logits a token at a time, as `Model41` does). Snapshots, restores, forks
and resets are V4's (`stage.StageWorker`); exporting, importing and truncating a session's layer
tensors, and drafting, are V4's only and refused.
"""

from __future__ import annotations

import time

import torch

from dwarfstar.distributed.link import Message
from dwarfstar.distributed.membership import LayerSlice
from dwarfstar.distributed.protocol import (
    FLAG_LOGITS,
    DistError,
    activation_nbytes,
    decode_activation,
    encode_activation,
)
from dwarfstar.distributed.stage import StageWorker
from dwarfstar.model.forward_v41 import Streams41
from dwarfstar.model.model_v41 import Model41
from dwarfstar.model.state_v41 import PayloadState41


def encode_streams(streams: Streams41, state: PayloadState41, bits: int) -> torch.Tensor:
    """The streams [T, n, dim] and the mix [T, n] as bytes at `bits` (host values of `state`'s arrays)."""
    h, pre = (torch.from_numpy(state.host(a)) for a in (streams.h, streams.pre))
    return torch.cat((encode_activation(h, bits), encode_activation(pre, bits)))


def decode_streams(data: torch.Tensor, rows: int, model: Model41, state: PayloadState41, bits: int) -> Streams41:
    """`encode_streams`' bytes of `rows` positions as `state`'s arrays."""
    n, dim = model.args.hc_mult, model.args.dim
    cut = activation_nbytes(rows * n, dim, bits)
    h = decode_activation(data[:cut], (rows, n, dim), bits)
    pre = decode_activation(data[cut:], (rows, n), bits)
    return Streams41(state.array(h.numpy()), state.array(pre.numpy()))


class StageWorker41(StageWorker):
    def __init__(self, model: Model41, layers: LayerSlice) -> None:
        if model.layer_range != range(layers.first, layers.last):
            held = model.layer_range
            raise DistError(f"this process holds layers {held.start}:{held.stop}, not its slice {layers}")
        super().__init__(model, layers)  # type: ignore[arg-type]  # what V4's and V4.1's stages share

    @property
    def device(self) -> str:
        return "cpu"  # the boundary streams travel as host values (`encode_streams`)

    def _forward(self, msg: Message) -> Message:
        found = self._sessions_of(msg)
        if isinstance(found, Message):
            return found
        sessions, spans = found
        if len(sessions) != 1:
            raise DistError(f"a V4.1 pass carries one sequence, not {len(sessions)}")
        (session,), (span,) = sessions, spans
        state, t, bits = session.state, self.model.transformer, msg.header.bits
        started = time.perf_counter()
        with torch.inference_mode():
            streams = decode_streams(msg.payload.cpu(), len(span), self.model, state, bits)
            out = t.run(t.begin(span, state), state, streams)
            if self.layers.holds_head:
                payload, flags = t.logits(out).float().cpu().contiguous().view(torch.uint8), FLAG_LOGITS
            else:
                payload, flags = encode_streams(out, state, bits), 0
        compute_us = int((time.perf_counter() - started) * 1e6)
        self._advanced(msg, sessions, spans)
        return self._reply(msg, payload=payload, flags=flags, compute_us=compute_us)

    def _refused(self, msg: Message) -> Message:
        raise DistError(f"{msg.header.op.name} is not part of a V4.1 route")

    _export = _import = _truncate = _draft = _refused
