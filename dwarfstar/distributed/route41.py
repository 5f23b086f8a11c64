"""The coordinator of a DeepSeek V4.1 route: its own first layers (a `Model41` holding them), the workers'
links (`route.Route`'s membership, relaying and session bookkeeping), and the session layer's `Backend`.

A pass runs the coordinator's layers on one sequence's tokens and relays the boundary streams
(`stage41.encode_streams`) through the workers in layer order; the last one answers with the last
position's logits. A call of all logits runs a token at a time, as `Model41` runs it; a long prompt goes
in passes of `prefill_chunk` tokens, one after another. A stage that holds a session out of step
(MISMATCH, MISSING) makes the coordinator replay the session's tokens through the route, as V4's does;
a pass that fails otherwise leaves the session to be replayed before its next use.

`RouteState41` is a sequence on the route: the coordinator's own layers in the backend's state
(`local`), the rest on the workers under its session id. Snapshots, restores and forks reach the workers
(V4's SNAPSHOT, RESTORE, FORK); saving a session's state to a payload, images and speculation do not run
on a V4.1 route.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dwarfstar.distributed.backend import RouteFront
from dwarfstar.distributed.link import Message
from dwarfstar.distributed.protocol import DistError, Header, Op, SegmentRecord, extend_hash
from dwarfstar.distributed.route import Hop, ReplayNeeded, Route
from dwarfstar.distributed.route_state import RouteSession
from dwarfstar.distributed.stage41 import encode_streams
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.model_v41 import Model41


class Route41(Route):
    local: Model41

    @property
    def local_device(self) -> str:
        return "cpu"  # the boundary streams travel as host values (`encode_streams`)

    def step(self, state: RouteState41, tokens: list[int]) -> torch.Tensor:
        """The logits [vocab] after `tokens`, which continue `state`, through every stage; `state`
        advanced. A stage out of step replays the session once; a pass that fails leaves it to replay."""
        history = len(state.tokens)
        try:
            try:
                return self._pass(state, tokens)
            except ReplayNeeded as why:
                self.mismatches += 1
                self.log(f"[dist] {why}: replaying session {state.session_id}")
                del state.tokens[history:]
                self.rebuild(state)
            try:
                return self._pass(state, tokens)
            except ReplayNeeded as again:
                raise DistError(f"a stage still disagrees after replaying the session: {again}") from None
        except BaseException:
            del state.tokens[history:]  # the coordinator's layers ran them: replay the rest before the next use
            state.dirty = True
            raise

    def _pass(self, state: RouteState41, tokens: list[int]) -> torch.Tensor:
        before = state.token_hash()
        segment = SegmentRecord(state.session_id, state.pos, len(tokens), before, extend_hash(before, tokens))
        t, local = self.local.transformer, state.local
        started = time.perf_counter()
        with torch.inference_mode():
            streams = t.run(t.begin(tokens, local), local, t.enter(tokens))
            payload = encode_streams(streams, local, self.options.bits)
        hop = Hop(str(self.local_layers), "coordinator", len(tokens), (time.perf_counter() - started) * 1e3)
        header = Header(Op.FORWARD, self.next_request(), 1, len(tokens), payload.numel(), self.options.bits)
        msg = Message(header, [segment], torch.tensor(tokens, dtype=torch.int64), payload)
        return self.through_stages(msg, [hop], 1)[0]

    def sync(self, state: RouteState41) -> None:  # type: ignore[override]
        """Before a state is used: reset released sessions, replay a lost one."""
        with self.lock:
            if self.released:
                dropped, self.released[:] = list(self.released), []
                self._broadcast(Op.RESET, [SegmentRecord(s, 0, 0, 0, 0) for s in dropped])
            if state.dirty:
                self.rebuild(state)

    def rebuild(self, state: RouteState41) -> None:  # type: ignore[override]
        """Replay the state's tokens through every stage from an empty state."""
        tokens, logits = list(state.tokens), state.logits
        self.replays += 1
        self._broadcast(Op.RESET, [SegmentRecord(state.session_id, 0, 0, 0, 0)])
        state.local, state.dirty = self.local.new_state(), False
        state.reset_hash()
        step = self.options.prefill_chunk
        try:
            for at in range(0, len(tokens), step):
                logits = self._pass(state, tokens[at : at + step])
        except BaseException as exc:
            state.local, state.dirty = self.local.new_state(), True  # all of it to replay before the next use
            state.local.tokens.extend(tokens)
            state.logits = logits
            if isinstance(exc, ReplayNeeded):
                raise DistError(f"replaying session {state.session_id} failed: {exc}") from None
            raise
        state.logits = logits


@dataclass
class RouteSnapshot41:
    """A route state's snapshot: the coordinator's layers (`local`, the backend's snapshot), the request id
    the workers keep theirs under, and the hash of its tokens."""

    local: Any
    request: int
    token_hash: int

    @property
    def pos(self) -> int:
        return self.local.pos

    @property
    def tokens(self) -> list[int]:
        return self.local.tokens

    def nbytes(self) -> int:
        return self.local.nbytes()


class RouteState41(RouteSession):
    """A sequence on a V4.1 route, as the session layer uses a state: its tokens, logits, snapshots."""

    def __init__(self, route: Route41) -> None:
        self.route, self.local = route, route.local.new_state()
        self.join(route)

    @property
    def tokens(self) -> list[int]:
        return self.local.tokens

    @property
    def pos(self) -> int:
        return self.local.pos

    @property
    def logits(self) -> torch.Tensor | None:
        return self.local.logits

    @logits.setter
    def logits(self, value: torch.Tensor | None) -> None:
        self.local.logits = value

    def nbytes(self) -> int:
        """The coordinator's part (the workers hold the rest)."""
        return self.local.nbytes()

    def snapshot(self) -> RouteSnapshot41:
        self.route.sync(self)
        local = self.local.snapshot()
        return RouteSnapshot41(local, self.route.snapshot(self), self.token_hash())

    def can_restore(self, snap: Any) -> bool:
        return isinstance(snap, RouteSnapshot41) and self.local.can_restore(snap.local)

    def restore(self, snap: RouteSnapshot41) -> None:
        if not isinstance(snap, RouteSnapshot41):
            raise DistError("a route state restores only snapshots taken on the route")
        self.route.sync(self)
        self.local.restore(snap.local)
        self.route.restore(self, snap)

    def __deepcopy__(self, memo: dict) -> RouteState41:
        """A fork: a new session id on every stage holding the same sequence."""
        self.route.sync(self)
        twin = RouteState41(self.route)
        twin.local = copy.deepcopy(self.local)
        self.route.fork(self, twin)
        return twin


class RouteBackend41(RouteFront):
    """A V4.1 route as the session layer's `Backend`: sessions, `decode_batch`, `run` and `serve` unchanged."""

    state_type = RouteState41
    route: Route41

    @torch.inference_mode()
    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[RouteState41],
        all_logits: bool = False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """Each sequence's logits ([T, vocab] with `all_logits`, else [1, vocab]), one after another, all
        checked before any runs."""
        self.check_call(states, images)
        ids = [self.local.check_call(t, s, None)[0] for t, s in zip(token_lists, states, strict=True)]
        out = []
        with self.route.lock:
            self.route.check_complete()
            for mine, state in zip(ids, states, strict=True):
                self.route.sync(state)
                step = 1 if all_logits else self.route.options.prefill_chunk
                logits = torch.stack([self.route.step(state, mine[at : at + step]) for at in range(0, len(mine), step)])
                state.logits = logits[-1]
                out.append(logits if all_logits else logits[-1:])
        return out
