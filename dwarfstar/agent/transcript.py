"""The agent's conversation and its exact tokens.

Layout: BOS [+ Think-Max preamble], the system text with the tools section (official renderer, tool
schemas from tools.py), then the entries: a user turn `<｜User｜>text<｜Assistant｜><think>`, the
assistant's generated tokens verbatim plus EOS, and tool results as a user turn of
`<tool_result>…</tool_result>` parts; an image the model viewed (view_image) is its block after its
result's line (engine/images.py: its ids come from the image's bytes). As in chat.py, replies stay
the token ids the model produced, so re-rendering a transcript (after a restart, on /switch) gives
back exactly the tokens of its KV, and the renderer keeps every piece of user or tool text plain:
nothing in a file or a command's output can become a control token.

After a compaction the summary joins the system text, and the entries hold only the verbatim tail.
The saved form (JSON) names each viewed image by the SHA-256 of its bytes, with its media type, its
file and the result it follows; the bytes are kept apart (store.py), read back through `read_image`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from dwarfstar.agent.tools import TOOLS
from dwarfstar.console.chat import ThinkMode, head_effort
from dwarfstar.engine.images import ImageEncoder, expand
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.prompt.images import MEDIA_TYPES, SLOT_CLOSE, SLOT_OPEN, ImageError, ImagePart, digest, slot
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import OFFICIAL
from dwarfstar.tokenizer.tokenizer import Tokenizer

DEFAULT_SYSTEM = "You are a helpful coding assistant running inside dwarfstar agent."
TITLE_CHARS = 70

AGENT_PROMPT = """You are a coding agent running in a local workspace: {root}
You work by calling tools in the DSML format described below, and you see their results as <tool_result> \
blocks. Tool calls are not allowed inside <think></think>: finish thinking, then call tools.

Rules:
- Read a file before you edit it. Line edits are accepted only for lines you were shown and that have not \
changed since; otherwise read them again or use the exact old/new form.
- Keep changes small and check them: run the tests or the program with bash.
- bash runs with the workspace as its current directory. A long command continues in the background; \
follow it with bash_status, end it with bash_stop.
- Files outside the workspace are off limits unless the user allows it.
- When the task is done, answer briefly: what you changed and how you checked it."""

SUMMARY_HEADING = "## Summary of the work so far (the earlier conversation was compacted)"
_SHA256 = re.compile(r"[0-9a-f]{64}")

# the bytes of a saved image, named by the SHA-256 of its bytes (hex), checked against it
ImageReader = Callable[[str], bytes]


class TranscriptError(DwarfStarError):
    """A saved transcript that cannot be read back."""


@dataclass
class Entry:
    kind: str  # "user", "tools" (tool results) or "assistant"
    text: str = ""  # a user turn's text; on a tools turn, what the user said after an interrupted round
    results: list[str] = field(default_factory=list)  # tool results, in call order
    ids: list[int] = field(default_factory=list)  # an assistant turn's generated tokens, EOS excluded
    thinking: bool = True  # user and tools turns: whether the reply opens with <think>
    images: dict[int, ImagePart] = field(default_factory=dict)  # a tools turn's viewed images, by result index

    def messages(self) -> list[dict[str, str]]:
        """A user or tools turn's messages. A viewed image's slot follows its result's line; in a turn
        with images, the characters slots are made of become U+FFFD in its text, so no file or command
        output can place one."""
        if self.kind == "user":
            return [{"role": "user", "content": self.text}]
        order = sorted(self.images)
        plain = str.maketrans({SLOT_OPEN: "\ufffd", SLOT_CLOSE: "\ufffd"}) if self.images else {}
        # the official renderer merges the user's text into the tool results' turn
        messages = [
            {"role": "tool", "content": text.translate(plain) + (f"\n{slot(order.index(n))}" if n in order else "")}
            for n, text in enumerate(self.results)
        ]
        return messages + ([{"role": "user", "content": self.text.translate(plain)}] if self.text else [])

    def to_json(self) -> dict[str, Any]:
        saved = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "images"}
        saved["images"] = [
            {"result": n, "sha256": digest(part.data).hex(), "media_type": part.media_type, "where": part.where}
            for n, part in sorted(self.images.items())
        ]
        return saved

    @classmethod
    def from_json(cls, data: Any, read_image: ImageReader) -> Entry:
        """An entry's saved form; entries saved before images were kept have no "images"."""
        if not isinstance(data, dict):
            raise ValueError(f"an entry {data!r}")
        entry = cls(**{k: v for k, v in data.items() if k != "images"})
        for saved in data.get("images", []):
            n, sha, media_type, where = saved["result"], saved["sha256"], saved["media_type"], saved["where"]
            if entry.kind != "tools" or not isinstance(n, int) or not 0 <= n < len(entry.results) or n in entry.images:
                raise ValueError(f"an image placed at result {n!r} of a {entry.kind} turn")
            if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
                raise ValueError(f"an image named {sha!r}, not by a SHA-256")
            if media_type not in MEDIA_TYPES or not isinstance(where, str):
                raise ValueError(f"an image of media type {media_type!r} from {where!r}")
            entry.images[n] = ImagePart(read_image(sha), media_type, where)
        return entry


@dataclass
class Transcript:
    system: str  # the whole system text: the agent prompt plus the user's -sys text
    mode: ThinkMode
    entries: list[Entry] = field(default_factory=list)
    summary: str | None = None
    first_prompt: str | None = None  # kept by compaction, which may drop the first user turn
    level: int | None = None  # a V4.1 think level 1..100 (`--think-level`); None: the mode's

    @property
    def thinking(self) -> bool:
        return self.mode is not ThinkMode.NOTHINK

    @property
    def title(self) -> str:
        first = self.first_prompt or next((e.text for e in self.entries if e.text), "")
        return " ".join(first.split())[:TITLE_CHARS]

    def user_turns(self) -> list[str]:
        return [e.text for e in self.entries if e.text]

    # -- tokens -----------------------------------------------------------------------------------
    @property
    def images(self) -> list[ImagePart]:
        """The viewed images, in the conversation's order."""
        return [e.images[n] for e in self.entries for n in sorted(e.images)]

    def head_ids(
        self, tokenizer: Tokenizer, efforts: str, with_summary: bool = True, tools: list[dict[str, Any]] = TOOLS
    ) -> list[int]:
        """The system turn's tokens, declaring `tools`; `efforts`: the model's release
        (`ModelArgs.reasoning_efforts`), whose effort preamble opens them (`console.chat.head_effort`)."""
        system = self.system
        if with_summary and self.summary:
            system += f"\n\n{SUMMARY_HEADING}\n\n{self.summary}"
        thinking, effort = head_effort(self.mode, self.level, efforts)
        head = render_conversation(
            [{"role": "system", "content": system}],
            tools=tools,
            thinking=thinking,
            reasoning_effort=effort,
            options=replace(OFFICIAL, efforts=efforts),
        )
        return tokenizer.encode_prompt(head.parts)

    def entry_prompt(
        self, entry: Entry, tokenizer: Tokenizer, eos: int, images: ImageEncoder | None = None, base: int = 0
    ) -> tuple[list[int], list[ImageSpan]]:
        """An entry's tokens and its image blocks, its first token at position `base` (the blocks' offsets
        are their positions: where a Vision-Exp block sits decides its leading pads); `images`: the
        agent's vision encoder."""
        if entry.kind == "assistant":
            return [*entry.ids, eos], []
        parts = render_conversation(entry.messages(), thinking=entry.thinking, add_bos=False).parts
        if not entry.images:
            return tokenizer.encode_prompt(parts), []
        if images is None:
            raise TranscriptError("this conversation holds images: it needs a vision encoder (--vision FILE)")
        try:
            return expand(images, tokenizer, parts, [entry.images[n] for n in sorted(entry.images)], base)
        except ImageError as exc:
            raise TranscriptError(f"cannot show an image again: {exc}") from None

    def prompt(
        self,
        tokenizer: Tokenizer,
        eos: int,
        efforts: str,
        tools: list[dict[str, Any]] = TOOLS,
        images: ImageEncoder | None = None,
    ) -> tuple[list[int], list[ImageSpan]]:
        """The whole transcript's tokens and image blocks (offsets into them)."""
        ids, spans = self.head_ids(tokenizer, efforts, tools=tools), []
        for entry in self.entries:
            more, blocks = self.entry_prompt(entry, tokenizer, eos, images, base=len(ids))
            spans += blocks
            ids += more
        return ids, spans

    # -- saved form -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "mode": self.mode.value,
            "summary": self.summary,
            "first_prompt": self.first_prompt,
            "level": self.level,
            "entries": [e.to_json() for e in self.entries],
        }

    @classmethod
    def from_json(cls, data: Any, read_image: ImageReader) -> Transcript:
        """The saved form back; `read_image` gives the bytes of the images it names (its errors pass)."""
        try:
            entries = [Entry.from_json(e, read_image) for e in data["entries"]]
            if any(e.kind not in ("user", "tools", "assistant") for e in entries):
                raise ValueError("unknown entry kind")
            first = data.get("first_prompt")  # absent in sessions saved before it existed
            if first is not None and not isinstance(first, str):
                raise ValueError("first_prompt must be a string")
            level = data.get("level")  # absent in sessions saved before think levels
            if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
                raise ValueError("level must be an integer")
            return cls(str(data["system"]), ThinkMode(data["mode"]), entries, data.get("summary"), first, level)
        except (KeyError, TypeError, ValueError) as exc:
            raise TranscriptError(f"bad transcript: {exc}") from None


def system_text(root: str, extra: str) -> str:
    prompt = AGENT_PROMPT.format(root=root)
    return f"{prompt}\n\n{extra}" if extra else prompt
