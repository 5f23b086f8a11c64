"""`RouteState`: a session's state on a route, as the session layer and the payload code see it.

Its own slot in the coordinator's cache holds the coordinator's layers; the other layers live on
the workers under the state's session id. The methods the session layer calls (snapshot, restore,
deepcopy) reach the workers too, and the payload code reads and writes the remote layers through the
same accessors it uses on one process: reads gather them from the workers (once per position),
writes are kept and sent as one IMPORT per worker before the state is next used. So
`write_payload` of a route state is the single-process payload byte for byte, and `read_payload`
into one splits it across the current route.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dwarfstar.distributed.membership import LayerSlice
from dwarfstar.distributed.protocol import FNV_OFFSET, DistError, extend_hash
from dwarfstar.model.forward import Transformer
from dwarfstar.model.state import SequenceState, StateSnapshot


@dataclass
class RouteSnapshot(StateSnapshot):
    request: int = 0  # the id the workers keep their part of the snapshot under
    token_hash: int = FNV_OFFSET  # the rolling hash of its tokens


class StateRoute(Protocol):
    """What a route state asks of its route (`route.Route`): its local model and layers, session ids,
    and the workers' side of gathering, syncing, snapshots and forks."""

    local: Transformer
    local_layers: LayerSlice
    released: list[int]  # session ids of dropped states

    def new_session_id(self) -> int: ...
    def export(self, state: RouteState) -> dict: ...
    def sync(self, state: RouteState) -> None: ...
    def snapshot(self, state: RouteState) -> int: ...
    def restore(self, state: RouteState, snap: RouteSnapshot) -> None: ...
    def fork(self, state: RouteState, twin: RouteState) -> None: ...


class RouteSession:
    """A sequence as a route's workers know it: its session id, whether they lost it, and the rolling hash
    of its tokens (`tokens`: the subclass's), which each pass's header carries."""

    tokens: list[int]

    def join(self, route: StateRoute) -> None:
        self.session_id = route.new_session_id()
        self.dirty = False  # the workers lost this session (a worker was replaced): replay before use
        self._hash = (0, FNV_OFFSET)  # (tokens covered, their rolling hash)
        weakref.finalize(self, route.released.append, self.session_id)

    def token_hash(self) -> int:
        """The rolling hash of the state's tokens, extended from the last call's."""
        covered, value = self._hash
        value = extend_hash(value, self.tokens[covered:])
        self._hash = (len(self.tokens), value)
        return value

    def reset_hash(self) -> None:
        """The tokens were replaced, not extended (restore, replay, import)."""
        self._hash = (0, FNV_OFFSET)

    def rewound_to(self, snap: RouteSnapshot) -> None:
        """The tokens were cut back to the snapshot's (and maybe extended since): its hash holds."""
        self._hash = (snap.pos, snap.token_hash)


class RouteState(SequenceState, RouteSession):
    def __init__(self, route: StateRoute, near: int | None = None) -> None:
        super().__init__(route.local.cache, near)
        self.route = route
        self.join(route)
        self.pending: dict[int, dict[str, np.ndarray]] = {}  # remote layer -> parts written, to IMPORT
        self.gathered: tuple[int, dict[str, np.ndarray]] | None = None  # (pos, remote parts) from EXPORT

    def rewound_to(self, snap: RouteSnapshot) -> None:
        super().rewound_to(snap)
        self.gathered = None

    def is_local(self, il: int) -> bool:
        return il < self.route.local_layers.last

    # -- remote layers through the single-process accessors --------------------------------------------
    def _remote(self, il: int, name: str) -> Any:
        if self.gathered is None or self.gathered[0] != self.pos:
            self.gathered = (self.pos, self.route.export(self))
        try:
            return self.cache.storage.from_numpy(self.gathered[1][f"{il}/{name}"])
        except KeyError:
            raise DistError(f"no stage returned layer {il}'s {name}") from None

    def part(self, il: int, name: str) -> Any:
        if self.is_local(il):
            return super().part(il, name)
        if name == "raw" or name.endswith("_rows"):  # kept in ring/capacity layout on the worker only
            raise DistError(f"layer {il}'s {name} lives on a worker; read it with raw_window or rows")
        return self._remote(il, name)

    def raw_window(self, il: int, end: int | None = None) -> Any:
        if self.is_local(il):
            return super().raw_window(il, end)
        if end not in (None, self.pos):
            raise DistError("a remote layer's window is read at the state's position only")
        return self._remote(il, "raw")

    def rows(self, il: int, kind: str, end: int | None = None) -> Any:
        if self.is_local(il):
            return super().rows(il, kind, end)
        spec = self.cache.compressors[il][kind]
        return self._remote(il, f"{kind}_rows")[: (self.pos if end is None else end) // spec.ratio]

    def write(self, il: int, name: str, value: Any, lo: int = 0) -> None:
        if self.is_local(il):
            super().write(il, name, value, lo)
            return
        if lo:
            raise DistError("a remote layer is written whole (from a payload), not at an offset")
        self.pending.setdefault(il, {})[name] = self.cache.storage.to_numpy(value)
        self.gathered = None

    def store_window(self, il: int, rows: Any, end: int) -> None:
        if self.is_local(il):
            super().store_window(il, rows, end)
            return
        self.pending.setdefault(il, {})["raw"] = self.cache.storage.to_numpy(rows)[-self.cache.args.window :]
        self.gathered = None

    # -- what the session layer calls ------------------------------------------------------------------
    def snapshot(self) -> RouteSnapshot:
        """The coordinator's fixed parts copied, the workers told to keep theirs under a request id."""
        self.route.sync(self)
        snap = self.local_snapshot(0)
        snap.request = self.route.snapshot(self)
        return snap

    def local_snapshot(self, request: int) -> RouteSnapshot:
        """The coordinator's fixed parts only: the workers take theirs under `request` themselves
        (a FLAG_VERIFY pass)."""
        copy = self.cache.storage.copy
        layers = {
            il: {
                name: copy(SequenceState.part(self, il, name)) for name in self.parts(il) if not name.endswith("_rows")
            }
            for il in range(self.route.local_layers.last)
        }
        logits = None if self.logits is None else self.logits.clone()
        epoch = len(self.rewinds)
        return RouteSnapshot(
            self.serial, self.pos, list(self.tokens), logits, layers, epoch, request, self.token_hash()
        )

    def restore(self, snap: StateSnapshot) -> None:
        if not isinstance(snap, RouteSnapshot):
            raise DistError("a route state restores only snapshots taken on the route")
        self.route.sync(self)
        super().restore(snap)  # the coordinator's layers (the snapshot holds no others)
        self.gathered = None
        self.route.restore(self, snap)

    def __deepcopy__(self, memo: dict) -> RouteState:
        """A fork: a new session id on every stage holding the same sequence."""
        self.route.sync(self)
        twin = RouteState(self.route, near=self.slot[0])
        self.fork_into(twin)  # the coordinator's layers (its cache holds no others)
        self.route.fork(self, twin)
        return twin
