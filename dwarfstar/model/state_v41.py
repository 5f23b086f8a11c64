"""What a V4.1 sequence carries between forward calls (issue 33; V4.1 note §1 "KV cache per sequence").

Enough for chunked prefill and decode on one sequence: the tokens so far (the Engram hash looks back 3
positions), per layer the window rows of the last `window - 1` positions (a query at p reads p - window + 1
.. p; its own call supplies the rest), per kv-source layer its compressed rows and index keys, and per
ratio-2 source the compressor frontier (the unfinished group's 2 slots). Reuse and reindex layers own no
compressed cache: they read their source's. Everything is float32 torch tensors, the reference's layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dwarfstar.model.config_v41 import ModelArgs41


@dataclass
class SequenceState41:
    window: int  # the sliding window: a query reads this many positions, its own included
    tokens: list[int] = field(default_factory=list)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [<= window - 1, head_dim]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> compressed rows [G, head_dim]
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)  # kv source -> [G, index_head_dim]
    frontiers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # ratio-2 source

    @property
    def pos(self) -> int:
        """The position of the next token."""
        return len(self.tokens)


def new_sequence41(args: ModelArgs41) -> SequenceState41:
    """An empty sequence: no window rows, no compressed rows or index keys, no frontier yet."""
    state = SequenceState41(window=args.window)
    for il in range(args.n_layers):
        state.windows[il] = torch.zeros(0, args.head_dim)
    for il in args.kv_source_layers:
        state.rows[il] = torch.zeros(0, args.head_dim)
        state.index_keys[il] = torch.zeros(0, args.index_head_dim)
    return state
