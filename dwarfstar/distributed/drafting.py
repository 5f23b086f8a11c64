"""The last stage's MTP draft: one `DraftTrack` per speculating session, fed and asked for drafts by
the coordinator's DRAFT messages, holding the final streams its FORWARDs computed (FLAG_DRAFT).

The coordinator decides everything from positions (`RemoteTrack` mirrors the counts): which tokens
pair with the held rows and how many drafts to propose, so this side only runs the draft model. A
track is named by the coordinator's id for it; a DRAFT naming a track this stage does not hold (the
worker restarted, the session was replayed) is answered MISSING, and the coordinator starts a new
track where the target is.
"""

from __future__ import annotations

import time

import torch

from dwarfstar.distributed.protocol import DistError, DraftRequest
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.speculative.mtp import MTPDraft
from dwarfstar.speculative.track import DraftTrack


class StageDrafts:
    def __init__(self, draft: MTPDraft) -> None:
        self.draft = draft
        self.tracks: dict[int, tuple[int, DraftTrack]] = {}  # session -> (track id, track)

    def hold(self, session: int, streams) -> None:
        """A pass's final streams of a session, for its track (none: the session is not speculating)."""
        entry = self.tracks.get(session)
        if entry is not None:
            entry[1].hold(streams)

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
            self.tracks[session] = (request.track, DraftTrack(self.draft, request.shift, request.start))
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


def _sampler(sampling: dict | None) -> Sampler:
    """The coordinator's sampler as it stands: its rules, its seed and its next draw's counter."""
    if sampling is None:
        return Sampler(SamplingParams(temperature=0.0, seed=0))
    fields = {k: sampling[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    sampler = Sampler(SamplingParams(**fields, seed=sampling["seed"]))
    sampler.seed, sampler.step = sampling["seed"], sampling["step"]
    return sampler
