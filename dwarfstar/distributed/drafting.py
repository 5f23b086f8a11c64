"""The last stage's draft: one track per speculating session (the MTP block's `DraftTrack` or DSpark's
`DSparkTrack`), fed and asked for drafts by the coordinator's DRAFT messages, holding what its FORWARDs
computed (FLAG_DRAFT): the final streams, or DSpark's context rows from its target layers' streams,
captured in the pass as one process captures them, so the last stage must hold those layers.

The coordinator decides everything from positions (`RemoteTrack` mirrors the counts): which tokens
pair with the held rows and how many drafts to propose, so this side only runs the draft model. A
track is named by the coordinator's id for it; a DRAFT naming a track this stage does not hold (the
worker restarted, the session was replayed) is answered MISSING, and the coordinator starts a new
track where the target is.
"""

from __future__ import annotations

import time

import torch

from dwarfstar.distributed.membership import LayerSlice
from dwarfstar.distributed.protocol import DistError, DraftRequest
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.speculative.dspark import DSparkDrafter, DSparkTrack
from dwarfstar.speculative.mtp import MTPDraft
from dwarfstar.speculative.mtp_options import check_confidence
from dwarfstar.speculative.track import DraftTrack


def check_target_layers(target_layers: tuple[int, ...], last: LayerSlice) -> None:
    """A DSpark drafter's target layers all on the last stage (which captures their streams), else a
    DistError naming the layers it must hold."""
    missing = [il for il in target_layers if not last.first <= il < last.last]
    if missing:
        need = ", ".join(map(str, target_layers))
        raise DistError(
            f"DSpark on a route needs the drafter's target layers {need} on the last stage; it holds {last}, "
            f"without {', '.join(map(str, missing))}: start the last worker with --layers "
            f"{min(target_layers)}:output or lower"
        )


class StageDrafts:
    def __init__(self, draft: MTPDraft | DSparkDrafter) -> None:
        self.draft = draft
        self.tracks: dict[int, tuple[int, DraftTrack | DSparkTrack]] = {}  # session -> (track id, track)

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers whose streams a FLAG_DRAFT pass captures (none for the MTP block)."""
        return self.draft.target_layers if isinstance(self.draft, DSparkDrafter) else ()

    def hold(self, session: int, streams, captured: dict[int, object], rows: slice) -> None:
        """What a pass leaves for a session's track (`track.rows`: its final streams `streams`, or the
        rows `rows` of the `captured` target layers); none when the session is not speculating."""
        entry = self.tracks.get(session)
        if entry is not None:
            entry[1].hold(entry[1].rows(streams, captured, rows))

    def cut(self, session: int, target_pos: int) -> None:
        """The session's target state went back to `target_pos` (a restore, a truncate)."""
        entry = self.tracks.get(session)
        if entry is not None and not entry[1].cut(target_pos):
            del self.tracks[session]

    def drop(self, session: int) -> None:
        self.tracks.pop(session, None)

    def handle(
        self, session: int, state: SequenceState | None, request: DraftRequest
    ) -> tuple[list[int], torch.Tensor | None, int] | None:
        """Start, feed, then propose: the drafts, their draft logits [n, vocab] when sampling, and the
        compute time in us; None when the track (or the session, to propose) is not held here."""
        started = time.perf_counter()
        if request.start is not None:
            self.tracks[session] = (request.track, self._track(request))
        entry = self.tracks.get(session)
        if entry is None or entry[0] != request.track:
            return None
        track = entry[1]
        with torch.inference_mode():
            for tokens in request.feeds:
                if not 0 < len(tokens) <= track.held:
                    raise DistError(f"a draft feed of {len(tokens)} rows; the track holds {track.held}")
                track.feed_rows(tokens)
            drafts, logits = [], None
            if request.n:
                if state is None:
                    return None
                if not track.ready:
                    raise DistError("drafts asked of a track that has fed no row yet")
                drafts, rows = track.propose(
                    state.tokens + [request.pending], request.n, _sampler(request.sampling), request.margin
                )
                if request.sampling is not None and rows:
                    logits = torch.stack([row.float().cpu().reshape(-1) for row in rows]).contiguous()
        return drafts, logits, int((time.perf_counter() - started) * 1e6)

    def _track(self, request: DraftRequest) -> DraftTrack | DSparkTrack:
        assert request.start is not None
        if isinstance(self.draft, DSparkDrafter):
            check_confidence(request.confidence)
            return DSparkTrack(self.draft, request.start, request.confidence)
        return DraftTrack(self.draft, request.shift, request.start)


def _sampler(sampling: dict | None) -> Sampler:
    """The coordinator's sampler as it stands: its rules, its seed and its next draw's counter."""
    if sampling is None:
        return Sampler(SamplingParams(temperature=0.0, seed=0))
    fields = {k: sampling[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    sampler = Sampler(SamplingParams(**fields, seed=sampling["seed"]))
    sampler.seed, sampler.step = sampling["seed"], sampling["step"]
    return sampler
