"""What a V4.1 sequence carries between forward calls (issue 33; V4.1's reference `Attention` caches).

Enough for chunked prefill and decode on one sequence: the tokens so far (the Engram hash looks back 3
positions), per layer the window rows of the last `window - 1` positions (a query at p reads p - window + 1
.. p; its own call supplies the rest), per kv-source layer its compressed rows and index keys, and per
ratio-2 source the compressor frontier (the unfinished group's 2 slots). Reuse and reindex layers own no
compressed cache: they read their source's. Everything is float32 torch tensors, the reference's layout.

For the session layer (`session.Session`): the next-token `logits` after the last call, and
`snapshot`/`restore` for its checkpoints and truncation replays. A snapshot is a copy of everything
(the reference's simplest exact form: no row is shared, so every snapshot stays restorable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from dwarfstar.model.config_v41 import ModelArgs41


class PayloadState41(Protocol):
    """What a payload reads and writes of a V4.1 state, whichever backend's arrays hold its rows
    (`SequenceState41`'s torch tensors on a device, MLX's arrays): the rows as host float32 values."""

    tokens: list[int]
    logits: torch.Tensor | None
    windows: dict[int, Any]
    rows: dict[int, Any]
    index_keys: dict[int, Any]
    frontiers: dict[int, tuple[Any, Any]]

    def array(self, values: np.ndarray) -> Any: ...

    def host(self, rows: Any) -> np.ndarray: ...


@dataclass
class SequenceState41:
    window: int  # the sliding window: a query reads this many positions, its own included
    tokens: list[int] = field(default_factory=list)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [<= window - 1, head_dim]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> compressed rows [G, head_dim]
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [G, index_head_dim]
    frontiers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # ratio-2 source
    logits: torch.Tensor | None = None  # [vocab]: the next token's after the last call; None before one
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where its rows live

    @property
    def pos(self) -> int:
        """The position of the next token."""
        return len(self.tokens)

    def snapshot(self) -> SequenceState41:
        """A copy of the state as it is now (`restore` returns to it)."""
        return _copy(self)

    def can_restore(self, snap: SequenceState41) -> bool:
        """Every snapshot is a whole copy: any one of a sequence of this model can be returned to."""
        return snap.window == self.window

    def restore(self, snap: SequenceState41) -> None:
        """Return to `snap` (taken by `snapshot`); the snapshot stays usable."""
        if not self.can_restore(snap):
            raise ValueError(f"a snapshot of window {snap.window} cannot restore a state of window {self.window}")
        copy = _copy(snap)
        self.tokens, self.windows, self.rows = copy.tokens, copy.windows, copy.rows
        self.index_keys, self.frontiers, self.logits = copy.index_keys, copy.frontiers, copy.logits

    def array(self, values: np.ndarray) -> torch.Tensor:
        """Host float32 values as one of this state's rows arrays (a payload's rows coming in)."""
        return torch.from_numpy(values).to(self.device)

    def host(self, rows: torch.Tensor) -> np.ndarray:
        """One of this state's rows arrays as host float32 values (going out to a payload)."""
        return rows.detach().to("cpu", torch.float32).numpy()

    def nbytes(self) -> int:
        """Bytes of its tensors: window rows, compressed rows, index keys, frontiers and logits."""
        tensors = [*self.windows.values(), *self.rows.values(), *self.index_keys.values()]
        tensors += [t for pair in self.frontiers.values() for t in pair]
        tensors += [] if self.logits is None else [self.logits]
        return sum(int(t.nbytes) for t in tensors)


def _copy(state: SequenceState41) -> SequenceState41:
    return SequenceState41(
        state.window,
        list(state.tokens),
        {il: t.clone() for il, t in state.windows.items()},
        {il: t.clone() for il, t in state.rows.items()},
        {il: t.clone() for il, t in state.index_keys.items()},
        {il: (a.clone(), b.clone()) for il, (a, b) in state.frontiers.items()},
        None if state.logits is None else state.logits.clone(),
        state.device,
    )


def new_sequence41(args: ModelArgs41, device: torch.device | None = None) -> SequenceState41:
    """An empty sequence whose rows live on `device` (None: the CPU): no window rows, no compressed rows
    or index keys, no frontier yet."""
    state = SequenceState41(window=args.window, device=torch.device(device or "cpu"))
    for il in range(args.n_layers):
        state.windows[il] = torch.zeros(0, args.head_dim, device=state.device)
    for il in args.kv_source_layers:
        state.rows[il] = torch.zeros(0, args.head_dim, device=state.device)
        state.index_keys[il] = torch.zeros(0, args.index_head_dim, device=state.device)
    return state
