"""A live sequence on a backend: chunked prefill, decode, sampling, truncation, snapshots.

The session owns a `SequenceState` and never looks inside it beyond the shared layout, so every
backend gets the same behaviour. Truncation is exact: the state cannot be cut back in place (raw
window rows and compressor frontiers of the earlier position are gone), so the session keeps cheap
checkpoints and replays from the nearest one. A checkpoint is kept where a prefill pass ends on a
chunk boundary or on a mark: the caller marks where a prompt's messages start and where it ends
(`mark`), the places a client's next request is likeliest to cut back to, which then replay nothing.

Image blocks (`ImageSpan`, issue 34) come with the prompt that holds them (`prefill(..., images=)`): the
session keeps each by its first position, so a replay reruns it exactly, and never splits one between
passes (see `room`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from dwarfstar.backends.protocol import Backend
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.image_spans import ImageSpan, check_ids, cut_outside
from dwarfstar.model.state import StateSnapshot
from dwarfstar.prompt.dsml_guard import ToolGuard
from dwarfstar.sampling import Sampler, SamplingParams, redraw_refused

DEFAULT_CHUNK = 4096
Pass = Callable[[list[int], list[ImageSpan]], object]  # a prefill pass on the session's state: tokens, their blocks
MAX_CHECKPOINTS = 16  # checkpoints share row buffers; each holds only raw windows, frontiers and logits


class Cancelled(DwarfStarError):
    """The caller asked to stop (client gone, Ctrl+C); the state is consistent at a chunk boundary."""


@dataclass
class PrefillStats:
    requested: int = 0  # tokens the caller asked to add
    computed: int = 0  # tokens actually run through the model (replays included)


class Session:
    def __init__(self, backend: Backend, ctx: int | None = None, chunk: int = DEFAULT_CHUNK) -> None:
        args = backend.args
        ctx = ctx or args.max_seq_len
        if not 0 < ctx <= args.max_seq_len:
            raise DwarfStarError(f"context {ctx} is outside 1..{args.max_seq_len} for this model")
        if chunk <= 0:
            raise DwarfStarError(f"prefill chunk must be positive, got {chunk}")
        self.backend, self.ctx, self.chunk = backend, ctx, chunk
        self.state = backend.new_state()
        self.stats = PrefillStats()
        self._checkpoints: list[StateSnapshot] = []
        self._marks: set[int] = set()  # positions ahead where a pass ends and a checkpoint is kept
        self._images: dict[int, ImageSpan] = {}  # the sequence's image blocks by first position (offset: it)

    # -- read-only views ---------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    @property
    def logits(self) -> torch.Tensor | None:
        """Next-token logits after the last token (None before the first token)."""
        return self.state.logits

    def nbytes(self) -> int:
        """The state's bytes and its checkpoints' (their own copies; the rows they read are the state's)."""
        return self.state.nbytes() + sum(c.nbytes() for c in self._checkpoints)

    @property
    def checkpoints(self) -> list[int]:
        """Positions the session can be cut back to without replaying."""
        return [c.pos for c in self._checkpoints]

    @property
    def images(self) -> list[ImageSpan]:
        """The sequence's image blocks in order, each's `offset` its first position in the sequence."""
        return [self._images[p] for p in sorted(self._images)]

    def room(self, images: Sequence[ImageSpan] = ()) -> int:
        """Tokens the next prefill pass may take: up to the next chunk boundary or mark. A pass never
        splits an image block: with `images`, the blocks ahead (offsets from the next position), a
        boundary inside a block moves back to its start, or, where the block starts the pass, on to
        its end (the pass then runs past the boundary, and the checkpoint it keeps lands after the
        block)."""
        pos = self.state.pos
        end = pos + self.chunk - pos % self.chunk
        end = min((m for m in self._marks if pos < m < end), default=end)
        return cut_outside(images, end - pos)

    def mark(self, positions: Iterable[int]) -> None:
        """Keep a checkpoint at each of these positions ahead (a prompt's message starts, its end):
        passes end there. Replaces earlier marks."""
        self._marks = {p for p in positions if p > self.state.pos}

    # -- growing the sequence ------------------------------------------------------------------------
    def prefill(
        self,
        tokens: Sequence[int],
        on_chunk: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        images: Sequence[ImageSpan] = (),
        run: Pass | None = None,
    ) -> torch.Tensor:
        """Append tokens in chunks; returns the next-token logits.

        `on_chunk(done, total)` reports progress; `should_stop()` is polled between chunks and raises
        `Cancelled`, leaving the session valid at the last completed chunk. `images`: the image blocks
        among the tokens (`ImageSpan`, offsets into `tokens`, each wholly inside them, their positions
        holding image ids: `content_ids`), checked before any pass runs; each runs whole in one pass.
        `run(piece, spans)`: runs a pass on the state instead of the backend's forward (a speculator's,
        whose draft follows the target's passes).
        """
        tokens = list(tokens)
        self._check_room(len(tokens))
        spans = self._check_images(tokens, images)
        self.stats.requested += len(tokens)
        return self._run(tokens, spans, on_chunk, should_stop, run)

    def _run(
        self, tokens: list[int], spans: Sequence[ImageSpan] = (), on_chunk=None, should_stop=None, run=None
    ) -> torch.Tensor:
        """Run `tokens` from the state's position in passes (`run`, else the backend's forward); `spans`:
        their image blocks, offsets into `tokens`, in order."""
        done = 0
        while done < len(tokens):
            if should_stop is not None and should_stop():
                raise Cancelled(f"stopped after {done} of {len(tokens)} prompt tokens")
            # passes end on multiples of the chunk size and on marks, so checkpoints land on the same
            # positions whatever the caller's split (an image block moves such an end to one of its own)
            ahead = [replace(s, offset=s.offset - done) for s in spans if s.offset >= done]
            end = min(len(tokens), done + self.room(ahead))
            mine = [s for s in ahead if s.stop <= end - done]
            if run is None:
                self.backend.forward(tokens[done:end], self.state, all_logits=False, images=mine or None)
            else:
                run(tokens[done:end], mine)
            base = self.state.pos - (end - done)
            self._images.update((base + s.offset, replace(s, offset=base + s.offset)) for s in mine)
            self._computed(end - done)
            done = end
            if on_chunk is not None:
                on_chunk(done, len(tokens))
        return self.state.logits

    def decode(self, token: int) -> torch.Tensor:
        """Append one token (typically just sampled); returns the next-token logits."""
        return self.prefill([token])

    def generate(
        self,
        max_tokens: int,
        sampler: Sampler | SamplingParams,
        stop_tokens: Sequence[int] = (),
        should_stop: Callable[[], bool] | None = None,
        guard: ToolGuard | None = None,
    ) -> Iterator[int]:
        """Sample and append up to max_tokens tokens, yielding each; stops after a stop token.

        A stop token is yielded and kept in the sequence, as a completed assistant turn ends with EOS.
        A tool-call `guard` (prompt/dsml_guard.py) chooses each token from the draw and its logits.
        """
        if self.state.logits is None:
            raise DwarfStarError("nothing to continue: prefill a prompt first")
        sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
        stops = set(stop_tokens)
        limit = min(max_tokens, self.ctx - self.state.pos)
        if limit <= 0 or (should_stop is not None and should_stop()):
            return
        token = sample_next([self], [sampler])[0]
        unused = True  # a drawn token not yet yielded: its draw is taken back if it never is
        try:
            for i in range(limit):
                if i and should_stop is not None and should_stop():
                    return
                if guard is not None:
                    token = guard.choose(token, self.state.logits, sampler)
                    guard.push(token)
                if i + 1 == limit:
                    self.decode(token)  # nothing follows the last token
                    following = None
                else:  # the step that takes this token draws the next one with it: one sync a token
                    following = decode_batch([self], [token], [sampler])[0]
                unused = following is not None
                yield token
                if token in stops or following is None:
                    return
                token = following
        finally:
            if unused:
                sampler.withdraw()

    # -- going back ------------------------------------------------------------------------------------
    def truncate(self, n_tokens: int) -> None:
        """Keep only the first n_tokens, exactly as if the rest had never been seen: the image blocks
        among them rerun in the replay as they ran. A cut inside an image block is refused (the block
        would replay partly, which no prefill could have run): cut before its first position or after
        its last."""
        if not 0 <= n_tokens <= len(self.tokens):
            raise DwarfStarError(f"cannot truncate {len(self.tokens)} tokens to {n_tokens}")
        if n_tokens == len(self.tokens):
            return
        for span in self._images.values():
            if span.offset < n_tokens < span.stop:
                raise DwarfStarError(
                    f"cannot truncate to {n_tokens} tokens: an image block holds positions {span.offset}.."
                    f"{span.stop - 1}; cut at {span.offset} or at {span.stop} or later"
                )
        tokens = list(self.tokens[:n_tokens])
        start = self._best_checkpoint(n_tokens)
        if start is None:
            self.state = self.backend.new_state()
        else:
            self.state.restore(start)
        self._checkpoints = [c for c in self._checkpoints if c.pos <= self.state.pos]
        self._images = {p: s for p, s in self._images.items() if s.stop <= n_tokens}
        pos = self.state.pos
        replay = [replace(s, offset=s.offset - pos) for p, s in sorted(self._images.items()) if p >= pos]
        self._run(tokens[pos:], replay)

    def rebuild(self, n_tokens: int) -> None:
        """The state after the first `n_tokens` computed again from a checkpoint before its last token
        (or before the image block that ends there): a pass that raised midway may have written rows
        past them."""
        if n_tokens == 0:
            self.reset()
            return
        last = next((s for s in self._images.values() if s.offset < n_tokens <= s.stop), None)
        cut = n_tokens - 1 if last is None else last.offset
        tokens = self.tokens[cut:n_tokens]
        self.truncate(cut)
        self.prefill(tokens, images=() if last is None else [replace(last, offset=0)])

    def adopt(self, spans: Iterable[ImageSpan], ids: Sequence[int]) -> None:
        """Learn the rows of image blocks the sequence holds without them (a state read from the disk
        cache keeps a block's ids, not its rows), so that a cut behind them replays them: each of
        `spans` (offsets into `ids`, a prompt sharing a prefix with this sequence) whose positions
        this sequence holds with the same ids."""
        tokens = self.tokens
        for span in spans:
            held = span.stop <= len(tokens) and list(tokens[span.offset : span.stop]) == list(
                ids[span.offset : span.stop]
            )
            if held and span.offset not in self._images:
                self._images[span.offset] = span

    def snapshot(self) -> StateSnapshot:
        return self.state.snapshot()

    def restore(self, snap: StateSnapshot) -> None:
        """Back to a snapshot of this session (`snapshot`); the image blocks it holds stay known (a block
        the session has dropped since, by a cut before it, is not brought back: the replay of a later
        cut then refuses its ids)."""
        self.state.restore(snap)
        self._checkpoints = [c for c in self._checkpoints if c.pos <= snap.pos and self.state.can_restore(c)]
        self._images = {p: s for p, s in self._images.items() if s.stop <= snap.pos}

    def reset(self) -> None:
        self.state = self.backend.new_state()
        self._checkpoints.clear()
        self._images.clear()

    # -- internals -------------------------------------------------------------------------------------
    def _check_room(self, n: int) -> None:
        if self.state.pos + n > self.ctx:
            raise ContextOverflowError(
                f"context overflow: {self.state.pos} tokens in the session + {n} new exceed the context of {self.ctx}"
            )

    def _check_images(self, tokens: list[int], images: Sequence[ImageSpan]) -> list[ImageSpan]:
        """The call's image blocks in order, once they are known to lie inside it apart, to hold image
        ids, to be as wide as the model, and the ids outside them to be the vocabulary's (a clear error
        before any pass, not after some)."""
        spans = sorted(images, key=lambda s: s.offset)
        if spans:
            check_ids(torch.tensor(tokens, dtype=torch.long), tuple(spans), self.backend.args.vocab_size)
            for span in spans:
                span.check_width(self.backend.args.dim)
        return spans

    def _computed(self, n_tokens: int) -> None:
        """Count a pass's tokens; one that ended on a chunk boundary or a mark, or ran over one (an image
        block that starts the pass runs to its end), leaves a checkpoint where it ended."""
        self.stats.computed += n_tokens
        pos = self.state.pos
        crossed = {m for m in self._marks if pos - n_tokens < m <= pos}
        if crossed or pos // self.chunk > (pos - n_tokens) // self.chunk:
            self._marks -= crossed
            self._checkpoint()

    def _checkpoint(self) -> None:
        self._checkpoints.append(self.state.snapshot())
        if len(self._checkpoints) > MAX_CHECKPOINTS:
            # drop the one closest to the checkpoint before it (the newest stays: a retried turn cuts
            # back to it), so the rest stay spread over the sequence, the early ones a forked
            # conversation shares included
            gaps = [c.pos - (self._checkpoints[i - 1].pos if i else 0) for i, c in enumerate(self._checkpoints[:-1])]
            del self._checkpoints[gaps.index(min(gaps))]

    def _best_checkpoint(self, n_tokens: int) -> StateSnapshot | None:
        prefix = self.tokens[:n_tokens]
        usable = [
            c
            for c in self._checkpoints
            if c.pos <= n_tokens and c.tokens == prefix[: c.pos] and self.state.can_restore(c)
        ]
        return max(usable, key=lambda c: c.pos, default=None)


def _one_backend(sessions: Sequence[Session]) -> Backend:
    backend = sessions[0].backend
    if any(s.backend is not backend for s in sessions):
        raise DwarfStarError("batched sessions must share one backend")
    return backend


def sample_next(sessions: Sequence[Session], samplers: Sequence[Sampler]) -> list[int]:
    """Each session's next token, drawn from its logits by its sampler, all in one draw on the
    backend's device (one host sync): the callers above the session layer handle tokens only."""
    if not sessions:
        return []
    backend = _one_backend(sessions)
    if any(s.logits is None for s in sessions):
        raise DwarfStarError("nothing to continue: prefill a prompt first")
    drawn = backend.sample_batch(torch.stack([s.logits.reshape(-1) for s in sessions]), samplers)
    return redraw_refused([s.logits for s in sessions], samplers, drawn)


def prefill_batch(
    sessions: Sequence[Session],
    pieces: Sequence[Sequence[int]],
    images: Sequence[Sequence[ImageSpan]] | None = None,
) -> None:
    """Prompt pieces of several sessions on the same backend in one batched pass, so that requests
    which arrive together start decoding together.

    Each piece ends at or before its session's next chunk boundary or mark (where `Session.prefill`
    would split it; `Session.room` of the piece's image blocks), so the call is one forward: refused
    whole by its checks, or run whole. A session that reaches a boundary keeps a checkpoint there, as
    its own prefill would. `images`: each piece's image blocks (offsets into the piece), or None.
    """
    backend = _one_backend(sessions)
    pieces = [list(p) for p in pieces]
    if images is None:
        images = [()] * len(pieces)
    if len(images) != len(pieces):
        raise DwarfStarError(f"{len(images)} image span lists for {len(pieces)} pieces")
    spans = []
    for session, piece, mine in zip(sessions, pieces, images, strict=True):
        session._check_room(len(piece))
        spans.append(session._check_images(piece, mine))
        room = session.room(spans[-1])
        if len(piece) > room:
            raise DwarfStarError(f"a piece of {len(piece)} tokens crosses the checkpoint boundary {room} tokens ahead")
    states = [s.state for s in sessions]
    backend.forward_batch(pieces, states, all_logits=False, images=spans if any(spans) else None)
    for session, piece, mine in zip(sessions, pieces, spans, strict=True):
        base = session.state.pos - len(piece)
        session._images.update((base + s.offset, replace(s, offset=base + s.offset)) for s in mine)
        session.stats.requested += len(piece)
        session._computed(len(piece))


def decode_batch(
    sessions: Sequence[Session], tokens: Sequence[int], samplers: Sequence[Sampler] | None = None
) -> list[int] | None:
    """One decode step for several sessions on the same backend in a single batched pass.

    Each session's `logits` then holds its next-token logits, exactly as `session.decode` would leave it.
    With `samplers`, the step also draws each session's next token from them (the backend's
    `decode_sample`: inside a captured step where it has one) and returns those tokens.
    """
    if not sessions:
        return None if samplers is None else []
    backend = _one_backend(sessions)
    for session in sessions:
        session._check_room(1)
    states = [s.state for s in sessions]
    drawn = None
    if samplers is None:
        backend.forward_batch([[t] for t in tokens], states)
    else:
        drawn = redraw_refused([s.logits for s in states], samplers, backend.decode_sample(tokens, states, samplers))
    for session in sessions:
        session.stats.requested += 1
        session._computed(1)
    return drawn
