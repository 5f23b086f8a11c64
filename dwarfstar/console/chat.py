"""A chat on one live session: the transcript, prefix reuse, streamed replies, saved chats.

The transcript follows ds4's CLI (DS4_SURFACE §1.2): BOS [+ Think-Max preamble] [+ system], then
per turn `<｜User｜>text<｜Assistant｜><think>` (or `</think>`), every generated token, reasoning
included, and EOS. The renderer writes the head and the user parts; the replies stay the tokens the
model produced, never re-tokenized text, so a reply whose text would tokenize differently (or that
ends in half a UTF-8 character) still matches the live KV exactly. Each turn the whole transcript
is compared with the session's tokens and only the new suffix is computed.

Each turn keeps the thinking mode it was asked in, so `/think` and `/nothink` change only the turns
after them; switching Think-Max changes the preamble after BOS, and the next turn recomputes the
conversation, as in ds4. On a V4.1 model every thinking mode has its think level's prefix after BOS
(`head_effort`), so any switch between modes or levels recomputes it.

With a vision encoder (`run --vision`), a turn may carry images (`--image`, `/image`), read before its
text: each becomes its block (engine/images.py), whose ids come from the image's bytes, so the next
turn reuses the KV through it and a different image is never mistaken for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path

from dwarfstar.backends.protocol import Backend
from dwarfstar.console.diagnostics import Trace
from dwarfstar.console.terminal import PrefillProgress, Speed, StreamPrinter
from dwarfstar.engine.images import expand
from dwarfstar.engine.load import Engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.telemetry import summary as expert_summary
from dwarfstar.kvcache.payloads import read_payload, suffix_of, write_payload
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.prompt.efforts import THINK_MAX_MIN_CTX, Effort, has_think_levels
from dwarfstar.prompt.images import (
    ImageError,
    ImagePart,
    check_free_of_slots,
    keep_image,
    kept_image,
    read_image_file,
    slot,
)
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import OFFICIAL
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.loopguard import LoopGuard, Repetition
from dwarfstar.session.prefix import image_reuse
from dwarfstar.session.session import Cancelled, Session
from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer

DEFAULT_SYSTEM = "You are a helpful assistant"  # ds4's CLI default, without a period


class ThinkMode(Enum):
    NOTHINK = "nothink"
    THINK = "think"
    THINK_MAX = "think-max"


def allowed_mode(mode: ThinkMode, ctx: int) -> tuple[ThinkMode, str | None]:
    """ds4's gate: Think-Max below THINK_MAX_MIN_CTX becomes Think, with a warning."""
    if mode is ThinkMode.THINK_MAX and ctx < THINK_MAX_MIN_CTX:
        return ThinkMode.THINK, f"think-max needs --ctx >= {THINK_MAX_MIN_CTX}; using think"
    return mode, None


def head_effort(mode: ThinkMode, level: int | None, release: str) -> tuple[bool, Effort]:
    """How a chat's head (BOS and the system turn) renders: in thinking mode or not, at which effort. A V4
    release's head holds only Think-Max's preamble; a V4.1 head the prefix of `level` (`--think-level`
    1..100) or of the mode's preset (think 75, think-max 100) whenever the chat thinks."""
    if has_think_levels(release):
        if mode is ThinkMode.NOTHINK:
            return False, None
        return True, level or ("max" if mode is ThinkMode.THINK_MAX else None)
    max_effort = mode is ThinkMode.THINK_MAX
    return max_effort, "max" if max_effort else None


@dataclass
class Turn:
    user: str
    thinking: bool
    reply: list[int] = field(default_factory=list)  # generated tokens, EOS excluded
    images: tuple[ImagePart, ...] = ()  # read before the text, in order


@dataclass
class TurnStats:
    kept: int  # tokens of the live session reused
    prompt_tokens: int
    prefilled: int  # tokens run through the model to reach the prompt (replays included)
    prefill_s: float
    ids: list[int]  # generated tokens, EOS excluded
    decode_s: float
    # "stop" (EOS), "length", "interrupted" (during generation), "cancelled" (during prefill) or "repetition"
    # (the loop guard ended a reply that loops)
    finish: str


class Chat:
    def __init__(
        self,
        engine: Engine,
        backend: Backend,
        *,
        ctx: int,
        system: str,
        mode: ThinkMode,
        params: SamplingParams,
        max_tokens: int,
        trace: Trace | None = None,
        loop_guard: LoopGuard | None = None,
        level: int | None = None,
    ) -> None:
        """`level`: a V4.1 think level 1..100 (`--think-level`), kept until the mode is switched."""
        self.engine, self.backend = engine, backend
        self.loop_guard = loop_guard  # --loop-guard: a reply that loops ends with finish "repetition"
        self.tokenizer = engine.tokenizer
        self.eos = backend.args.eos_token_id
        self.session = Session(backend, ctx=ctx)
        self.system, self.mode, self.level = system, mode, level
        self.sampler = Sampler(params)  # one generator for the whole chat: a seed gives a reproducible chat
        self.max_tokens, self.trace = max_tokens, trace
        self.turns: list[Turn] = []
        self.images: list[ImagePart] = []  # attached for the next turn (`attach`)
        self.prefill_speed, self.decode_speed = Speed(), Speed()
        self.last: TurnStats | None = None

    # -- the transcript -----------------------------------------------------------------------------
    @property
    def thinking(self) -> bool:
        return self.mode is not ThinkMode.NOTHINK

    def attach(self, path: Path) -> ImagePart:
        """An image file for the next turn: read and checked now (a clear error for a missing file, an
        unknown format or a corrupt image), refused without a vision encoder."""
        if self.engine.images is None:
            raise DwarfStarError("images need a vision encoder: start with --vision FILE")
        try:
            part = read_image_file(path)
        except ImageError as exc:
            raise DwarfStarError(str(exc)) from None
        self.images.append(part)
        return part

    def prompt_ids(self, pending: str | None = None) -> list[int]:
        """The transcript's tokens, plus an unanswered user turn `pending` in the current mode."""
        return self.prompt(pending)[0]

    def prompt(self, pending: str | None = None) -> tuple[list[int], list[ImageSpan]]:
        """The transcript's tokens and image blocks, plus an unanswered user turn `pending` in the current
        mode with the images attached for it."""
        try:
            return self._prompt(pending)
        except ImageError as exc:
            raise DwarfStarError(str(exc)) from None

    def _prompt(self, pending: str | None) -> tuple[list[int], list[ImageSpan]]:
        release = self.backend.args.reasoning_efforts
        thinking, effort = head_effort(self.mode, self.level, release)
        head = render_conversation(
            [{"role": "system", "content": self.system}],
            thinking=thinking,
            reasoning_effort=effort,
            options=replace(OFFICIAL, efforts=release),
        )
        ids, spans = self.tokenizer.encode_prompt(head.parts), []
        turns = (
            self.turns if pending is None else [*self.turns, Turn(pending, self.thinking, images=tuple(self.images))]
        )
        for n, turn in enumerate(turns):
            check_free_of_slots(turn.user)
            content = "".join(slot(k) for k in range(len(turn.images))) + turn.user
            user = render_conversation([{"role": "user", "content": content}], thinking=turn.thinking, add_bos=False)
            if turn.images:
                more, blocks = expand(self.engine.images, self.tokenizer, user.parts, turn.images, base=len(ids))
                spans += blocks
                ids += more
            else:
                ids += self.tokenizer.encode_prompt(user.parts)
            if n < len(self.turns):
                ids += [*turn.reply, self.eos]
        return ids, spans

    def set_mode(self, mode: ThinkMode) -> str | None:
        self.mode, warning = allowed_mode(mode, self.session.ctx)
        self.level = None
        return warning

    def set_ctx(self, ctx: int) -> None:
        """A new, empty session of `ctx` tokens; the conversation is recomputed at the next turn."""
        limit = getattr(self.backend, "max_seq_len", self.backend.args.max_seq_len)
        if ctx > limit:
            raise DwarfStarError(f"the model was loaded for at most {limit} tokens; restart with --ctx {ctx}")
        self.session = Session(self.backend, ctx=ctx)

    # -- a turn ---------------------------------------------------------------------------------------
    def ask(self, text: str, should_stop: Callable[[], bool] = lambda: False) -> TurnStats:
        """Add a user turn, with the images attached for it, and stream the reply to stdout. A turn
        stopped during prefill is dropped (its images stay attached)."""
        ids, spans = self.prompt(pending=text)
        turn = Turn(text, self.thinking, images=tuple(self.images))
        stats = self.complete(ids, turn.thinking, should_stop, label=f"turn {len(self.turns) + 1}", images=spans)
        if stats.finish != "cancelled":
            turn.reply = stats.ids
            self.turns.append(turn)
            self.images = []
        return stats

    def complete(
        self,
        ids: list[int],
        thinking: bool,
        should_stop: Callable[[], bool] = lambda: False,
        label: str = "prompt",
        images: Sequence[ImageSpan] = (),
    ) -> TurnStats:
        """Bring the session to `ids` (with its image blocks, offsets into `ids`), reusing what it already
        holds, and stream the continuation."""
        if self.trace:
            shown = self.tokenizer.decode([t for t in ids if t < self.tokenizer.vocab_size])
            with_images = f", {len(images)} images" if images else ""
            self.trace.write(f"{label}: rendered prompt ({len(ids)} tokens{with_images})", shown)
        keep, later = image_reuse(self.session.tokens, ids, images)
        computed = self.session.stats.computed
        start = time.perf_counter()
        try:
            with PrefillProgress(len(ids) - keep) as progress:
                self.session.truncate(keep)
                self.session.prefill(ids[keep:], progress.update, should_stop, images=later)
            finish = None
        except Cancelled:
            finish = "cancelled"
        prefilled, prefill_s = self.session.stats.computed - computed, time.perf_counter() - start
        self.prefill_speed.add(prefilled, prefill_s)
        if self.trace:
            self.trace.write(f"cache: reused {keep} tokens, prefilled {prefilled}")
        out, decode_s = [], 0.0
        if finish is None:
            out, finish, decode_s = self.stream_reply(thinking, should_stop)
        self.last = TurnStats(keep, len(ids), prefilled, prefill_s, out, decode_s, finish)
        return self.last

    def stream_reply(self, thinking: bool, should_stop: Callable[[], bool]) -> tuple[list[int], str, float]:
        """Generate from the session's state, streaming text; returns (ids without EOS, finish, seconds)."""
        printer = StreamPrinter(thinking)
        detok = IncrementalDetokenizer(self.tokenizer)
        ids: list[int] = []
        finish = "length"
        start = time.perf_counter()
        repetition = Repetition(self.loop_guard) if self.loop_guard is not None else None
        for token in self.session.generate(self.max_tokens, self.sampler, [self.eos], should_stop):
            if token == self.eos:
                finish = "stop"
                break
            ids.append(token)
            printer.feed(detok.push(token))
            if repetition is not None and repetition.push(token):
                finish = "repetition"  # the loop guard (--loop-guard)
                break
        decode_s = time.perf_counter() - start
        if finish == "length" and should_stop():
            finish = "interrupted"
        printer.feed(detok.flush())
        printer.finish()
        self.decode_speed.add(len(ids) + (finish == "stop"), decode_s)
        if self.trace:
            self.trace.write(f"generated {len(ids)} tokens, finish {finish}", self.tokenizer.decode(ids))
            if repetition is not None and repetition.detail is not None:
                self.trace.write("loop guard", repetition.detail)
            if self.engine.experts is not None:  # the expert cache since the start (--ssd-streaming)
                self.trace.write("experts", json.dumps(expert_summary(self.engine.experts)))
        return ids, finish, decode_s

    # -- saved chats ------------------------------------------------------------------------------------
    def save(self, stem: Path) -> int:
        """Write the KV state (the payload of the model's family: ds4's DSV4 in `stem.dsv4`, or V4.1's DS41
        in `stem.ds41`: `kvcache.payloads.suffix_of`), the transcript (`stem.json`) and the turns' images
        (`stem.images/<sha256>`, `prompt.images.keep_image`); returns the state's bytes."""
        if not self.session.tokens:
            raise DwarfStarError("nothing to save yet")
        stem.parent.mkdir(parents=True, exist_ok=True)
        turns = []
        for turn in self.turns:
            try:
                images = [
                    {"sha256": keep_image(_images_of(stem), p.data), "media_type": p.media_type} for p in turn.images
                ]
            except ImageError as exc:
                raise DwarfStarError(str(exc)) from None
            turns.append(asdict(replace(turn, images=())) | {"images": images})
        with stem.with_suffix(suffix_of(self.backend.args)).open("wb") as out:
            size = write_payload(out, self.session.state, self.backend.args, self.session.ctx, self.session.chunk)
        meta = {"system": self.system, "mode": self.mode.value, "level": self.level, "turns": turns}
        stem.with_suffix(".json").write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
        return size

    def load(self, stem: Path) -> int:
        """Restore a saved chat without recomputing it; returns its token count."""
        try:
            meta = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
            data = stem.with_suffix(suffix_of(self.backend.args)).read_bytes()
        except (OSError, ValueError) as exc:
            raise DwarfStarError(f"cannot load {stem.name}: {exc}") from None
        state = read_payload(data, self.backend.args, self.session.ctx, self.session.chunk, self.backend.new_state)
        turns = [Turn(**(t | {"images": self._saved_images(stem, t.get("images", []))})) for t in meta["turns"]]
        if any(turn.images for turn in turns) and self.engine.images is None:
            raise DwarfStarError(f"{stem.name} holds images: start with --vision FILE to load it")
        self.session.reset()
        self.session.state = state
        self.system, self.mode, self.turns = meta["system"], ThinkMode(meta["mode"]), turns
        self.level = meta.get("level")  # absent in chats saved before think levels
        if any(turn.images for turn in turns):  # the state holds the blocks' ids: give it their rows
            ids, spans = self.prompt()
            self.session.adopt(spans, ids)
        return len(state.tokens)

    @staticmethod
    def _saved_images(stem: Path, saved: list[dict]) -> tuple[ImagePart, ...]:
        """A saved turn's images, read back and checked against their digests."""
        folder = _images_of(stem)
        try:
            return tuple(
                ImagePart(kept_image(folder, i["sha256"]), i["media_type"], str(folder / i["sha256"])) for i in saved
            )
        except ImageError as exc:
            raise DwarfStarError(f"cannot load {stem.name}: {exc}") from None


def _images_of(stem: Path) -> Path:
    """The folder a saved chat keeps its images in."""
    return stem.with_suffix(".images")
