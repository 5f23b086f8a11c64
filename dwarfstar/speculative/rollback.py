"""Rollback after a rejected draft without running the kept tokens again.

The verifying pass ran [pending, d_1..d_n] from position `start`; only the first `keep` of those
tokens stay. What the rejected tokens left behind, part by part (model/state.py's layout):

- raw-window ring: the rows of the rejected positions overwrote the ring rows of positions one
  window earlier, which the kept state still reads. They come back from the snapshot taken before
  the pass; the kept tokens' rows are taken from the ring as the pass left it (it held every row
  of the pass as long as the pass is no longer than the window).
- compressed rows: those the rejected tokens completed lie at or past (start + keep) // ratio,
  where nothing reads them until the kept sequence rewrites them.
- compressor frontiers: the window in progress at start + keep may have been pooled into a row
  and cleared by the rejected tokens, and its projections are not in the state any more. So the
  pass records each compressor's per-token projections (`CompressorTap`), and the rollback runs
  only the compressor over the kept tokens' rows, from the snapshot's frontier: no attention, no
  MoE, no projection.

The result is the state a run that never saw the rejected tokens builds, bit for bit on a backend
whose per-row arithmetic does not depend on how many rows a call has (the reference does not).
"""

from __future__ import annotations

from typing import Any

import torch

from dwarfstar.model.forward import Transformer
from dwarfstar.model.state import SequenceState, StateSnapshot


class CompressorTap:
    """While active, keeps a copy of the projections every compressor call of `model` receives.

    The forward pass hands the compressors their projections and then drops them; there is no
    hook for them in `Transformer`, so the tap wraps the backend's `Ops.compress` on the instance
    for the duration of one pass (`with tap:`) and removes the wrapper afterwards."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.calls: list[tuple[int, str, dict[str, Any]]] = []  # (layer, kind, {kv, gate} [T, width])

    def __enter__(self) -> CompressorTap:
        ops, copy = self.model.ops, self.model.cache.storage.copy
        original = ops.compress
        self.calls = []

        def compress(il: int, kind: str, proj: dict[str, Any], batch) -> None:
            # a copy: a backend may reuse the projection buffers in the next layer
            self.calls.append((il, kind, {key: copy(proj[key]) for key in (f"{kind}_kv", f"{kind}_gate")}))
            original(il, kind, proj, batch)

        ops.compress = compress
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.ops.compress  # the class's method again

    def of(self, rows: slice) -> list[tuple[int, str, dict[str, Any]]]:
        """The recorded calls cut to one sequence's rows of the batch."""
        return [(il, kind, {key: value[rows] for key, value in proj.items()}) for il, kind, proj in self.calls]


def ring_rows(state: SequenceState, il: int, lo: int, hi: int) -> Any:
    """A copy of the raw ring rows of positions lo..hi-1 (hi - lo <= window), oldest first."""
    window, ring = state.cache.args.window, state.part(il, "raw")
    first, last = lo % window, (hi - 1) % window + 1
    rows = ring[first:last] if first < last else state.cache.storage.cat((ring[first:], ring[:last]))
    return state.cache.storage.copy(rows)


def can_truncate(model: Transformer, verified: int) -> bool:
    """The ring holds every row of a pass of `verified` tokens only while it is no longer than the window."""
    return verified <= model.args.window


def truncate(
    model: Transformer,
    state: SequenceState,
    snap: StateSnapshot,
    projections: list[tuple[int, str, dict[str, Any]]],
    kept: list[int],
    logits: torch.Tensor | None,
    layers: range | None = None,
) -> None:
    """Leave `state` as if only `kept`, the first tokens of a pass whose compressor projections are
    `projections` (`CompressorTap.of`), had followed `snap`. `logits` [T, vocab] are the pass's;
    the state's next-token logits become row len(kept) - 1 (None: a pipeline stage without them).

    `layers`: the layers the state holds here (default every one): a pipeline stage truncates its
    own, and the base class's restore is used, as a route state's own would restore the other
    stages too, which truncate theirs themselves."""
    start, end = snap.pos, snap.pos + len(kept)
    layers = range(model.args.n_layers) if layers is None else layers
    rows = {il: ring_rows(state, il, start, end) for il in layers}
    SequenceState.restore(state, snap)
    for il, layer_rows in rows.items():
        state.store_window(il, layer_rows, end)
    batch = model.batch([kept], [state])
    model.embed(batch)  # the backend's per-call positions, which its compressors read
    for il, kind, proj in projections:
        model.ops.compress(il, kind, {key: value[: len(kept)] for key, value in proj.items()}, batch)
    model.advance(batch)
    if logits is not None:
        state.logits = logits[len(kept) - 1].clone()
