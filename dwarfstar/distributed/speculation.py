"""Speculative decoding on a route: the coordinator's `Speculator` runs as on one machine, with a
`RouteRunner` for its target and a `RemoteTrack` for its draft (the MTP block or DSpark's drafter),
which lives on the last stage.

- The last stage keeps the final streams of every pass it runs for a speculating session
  (FLAG_DRAFT) and feeds them to its MTP block; the coordinator sees them only as a row count
  (`HeldRows`), and mirrors the track's counts, so it computes the same feeds one process makes.
  Feeds are sent with the next DRAFT (drafting) or before the next pass, whichever comes first:
  the stage runs the same draft calls in the same order, so its drafts are one process's.
- A verify pass is an ordinary route pass with all logits and FLAG_VERIFY: every stage snapshots
  the sessions under the pass's request id and records its compressor projections. A rejected
  draft then truncates each stage in place (the coordinator's own layers here, a TRUNCATE to each
  worker, which also cuts the last stage's held rows); the token-prefix hashes are the snapshot's
  extended by the kept tokens, so no stage is found out of step.
- DSpark: the last stage captures its target layers' streams in the same passes (it must hold those
  layers) and keeps their context rows; the coordinator mirrors them as MTP rows of alignment 0
  (every held row is fed), so the same messages carry it, the track's confidence cut sent at its start.
- A track the last stage no longer holds (the worker restarted, the session was replayed) is
  restarted where the target is, with a message: drafting resumes after a pass, as for a server's
  session that already held a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dwarfstar.backends.protocol import Backend
from dwarfstar.distributed.protocol import FLAG_DRAFT, FLAG_VERIFY, DraftRequest
from dwarfstar.distributed.route import ReplayNeeded, Route
from dwarfstar.distributed.route_state import RouteSnapshot, RouteState
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.sampling import Sampler
from dwarfstar.speculative.rollback import CompressorTap, can_truncate, truncate
from dwarfstar.speculative.track import paired_tokens


@dataclass(frozen=True)
class HeldRows:
    """A pass's final streams, as the coordinator sees them: the last stage kept them."""

    n: int

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    def __getitem__(self, key: slice) -> HeldRows:
        return HeldRows(len(range(self.n)[key]))


@dataclass(frozen=True)
class RouteDraft:
    """The MTP draft of a route: its block is on the last stage (`RouteBackend.mtp_draft`)."""

    route: Route


@dataclass(frozen=True)
class RouteDSpark:
    """The DSpark drafter of a route: its settings here, its stages and heads on the last stage
    (`RouteBackend.dspark_draft`), which holds its target layers."""

    route: Route
    d: DSparkArgs
    confidence: float  # a block is cut at its first row below this (`--dspark-confidence`)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.d.target_layers

    def close(self) -> None:
        """Nothing to let go here: the last stage holds the drafter."""


class RemoteTrack:
    """A speculator's draft track on the last stage, its counts mirrored here (`DraftTrack`'s)."""

    def __init__(self, route: Route, state: RouteState, shift: int, confidence: float | None = None) -> None:
        """`confidence`: a DSpark track's cut (its shift 0: every held row is fed); None: the MTP block's."""
        self.route, self.target, self.shift, self.confidence = route, state, shift, confidence
        self.kind = "MTP" if confidence is None else "DSpark"
        self._restart()

    def _restart(self) -> None:
        self.id = self.route.new_session_id()  # unique on the route, like the session ids
        self.base, self.fed, self.held = self.target.pos, 0, 0
        self.ready, self.started = False, False
        self.feeds: list[list[int]] = []  # due on the stage, sent with the next message

    @property
    def fed_to(self) -> int:
        return self.base + self.fed

    def hold(self, streams: HeldRows) -> None:
        self.held += streams.n

    def feed(self, known: list[int], target_pos: int) -> None:
        tokens = paired_tokens(known, self.fed_to, target_pos, self.shift)
        if tokens:
            self.feeds.append(tokens)
            self.fed += len(tokens)
            self.held -= len(tokens)
            self.ready = True

    def flush(self) -> None:
        """Start the track or send its due feeds before a pass adds rows to it."""
        if self.feeds or not self.started:
            self._send(DraftRequest(self.id))

    def propose(
        self, sequence: list[int], n: int, sampler: Sampler, margin: float
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The last stage's drafts and their draft logits (sampling); none when the track was lost."""
        sampling = None
        if not sampler.params.greedy:
            p = sampler.params
            sampling = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p}
            sampling.update(seed=sampler.seed, step=sampler.step)
        reply = self._send(DraftRequest(self.id, pending=sequence[-1], n=n, margin=margin, sampling=sampling))
        if reply is None:
            return [], []
        drafts = reply.tokens.tolist()
        if sampling is None:
            return drafts, []
        for _ in drafts:  # the stage drew one uniform per draft from the sampler's stream
            sampler.advance()
        vocab = self.route.local.args.vocab_size
        return drafts, list(reply.payload.view(torch.float32).reshape(len(drafts), vocab))

    def _send(self, request: DraftRequest):
        if not self.started:
            request.start, request.shift = self.base, self.shift
            request.confidence = self.confidence or 0.0
        request.feeds, self.feeds = self.feeds, []
        try:
            reply = self.route.draft(self.target, request)
        except ReplayNeeded:
            self._restart()
            self.route.log(
                f"[dist] the {self.kind} draft of session {self.target.session_id} is gone from the last stage; "
                f"drafting restarts at position {self.base}"
            )
            self.flush()
            return None
        self.started = True
        return reply


@dataclass
class RouteTap:
    """A verify pass's record on the coordinator: its own layers' projections, and whether a replay
    ran inside the pass (then the recorded projections are not the pass's alone)."""

    tap: CompressorTap
    replayed: bool

    def of(self, rows: slice) -> list:
        return self.tap.of(rows)


class RouteRunner:
    """A speculator's target on a route (`decode.LocalRunner`'s methods)."""

    def __init__(self, target: Backend, route: Route) -> None:
        """`target`: the route as a backend (`RouteBackend`), which the speculator's session runs."""
        self.target, self.route = target, route
        self._snaps: list[RouteSnapshot] = []  # taken for the next verify pass

    def track(self, draft: Any, state: RouteState, shift: int) -> RemoteTrack:
        if not isinstance(draft, RouteDraft | RouteDSpark) or draft.route is not self.route:
            raise DwarfStarError(
                "a route's speculator drafts with the route's own draft (load_draft or load_speculation on the route)"
            )
        if isinstance(draft, RouteDSpark):
            return RemoteTrack(self.route, state, 0, draft.confidence)
        return RemoteTrack(self.route, state, shift)

    def run(
        self,
        tokens: list[int],
        state: RouteState,
        all_logits: bool,
        track: RemoteTrack,
        images: Sequence[ImageSpan] = (),
    ) -> tuple[torch.Tensor, HeldRows]:
        """The tokens through the route in its prefill chunks (not pipelined: the last stage holds
        each pass's rows in order), the last stage keeping their streams. A route takes no image
        blocks."""
        if images:
            raise DwarfStarError("a layer route does not take image blocks yet: run images on one machine")
        route, step = self.route, self.route.options.prefill_chunk
        with route.lock, torch.inference_mode():
            self._prepare([state], [track])
            parts = [
                route.forward([torch.tensor(tokens[at : at + step])], [state], all_logits, FLAG_DRAFT)[0]
                for at in range(0, len(tokens), step)
            ]
        return torch.cat(parts) if all_logits else parts[-1], HeldRows(len(tokens))

    def snapshot(self, state: RouteState) -> RouteSnapshot:
        """The coordinator's part; the stages take theirs in the verify pass, under its request id."""
        with self.route.lock:
            self.route.sync(state)
            snap = state.local_snapshot(0)
        self._snaps.append(snap)
        return snap

    def verify(
        self, token_lists: Sequence[Sequence[int]], states: Sequence[RouteState], tracks: Sequence[RemoteTrack]
    ) -> tuple[list[tuple[torch.Tensor, HeldRows, slice]], RouteTap]:
        route = self.route
        with route.lock, torch.inference_mode():
            self._prepare(states, tracks)
            request, replays = route.next_request(), route.replays
            for snap in self._snaps:
                snap.request = request
            self._snaps = []
            spans = [torch.tensor(tokens) for tokens in token_lists]
            with CompressorTap(route.local) as tap:
                logits = route.forward(spans, list(states), True, FLAG_DRAFT | FLAG_VERIFY, request)
        passes, at = [], 0
        for mine in logits:
            passes.append((mine, HeldRows(mine.shape[0]), slice(at, at + mine.shape[0])))
            at += mine.shape[0]
        return passes, RouteTap(tap, route.replays != replays)

    def can_truncate(self, verified: int, tap: RouteTap) -> bool:
        return not tap.replayed and can_truncate(self.route.local, verified)

    def truncate(
        self, state: RouteState, snap: RouteSnapshot, tap: RouteTap, rows: slice, kept: list[int], logits
    ) -> None:
        route = self.route
        with route.lock, torch.inference_mode():
            truncate(route.local, state, snap, tap.of(rows), kept, logits, range(route.local_layers.last))
            state.rewound_to(snap)
            route.truncate(state, snap, kept)

    def restore(self, state: RouteState, snap: RouteSnapshot) -> None:
        state.restore(snap)  # every stage, to the snapshot the verify pass took (the last: its held rows too)

    def _prepare(self, states: Sequence[RouteState], tracks: Sequence[RemoteTrack]) -> None:
        """As `RouteBackend.forward_batch` does, then the tracks' due messages."""
        self.route.check_complete()
        for state in states:
            self.route.sync(state)
        for track in tracks:
            track.flush()
