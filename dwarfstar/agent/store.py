"""Saved agent sessions: KV files in the server's disk-cache format, plus a small JSON sidecar each.

The directory (default `~/.dwarfstar/kvcache`, or `$DWARFSTAR_KVCACHE`, or `--kv-dir`) holds:
* `<sha1 of key>.kv`: a session's state, a KVC file exactly as the server's disk cache writes it
  (kvfile.py; reason AGENT_SESSION, key = `kvstore.tokens_key` of its tokens: their decoded text,
  each image id written out). Switching to it loads the state, with no prefill; the server could
  even serve a prompt that continues it.
* `agent-<id>.json`: the session's transcript (transcript.py), title, creation time, the name of
  its KV file, or none once `/strip` dropped it (a stripped session rebuilds by prefill), and the
  images its transcript names.
* `agent-images/<sha256>`: each image a saved transcript viewed (view_image), named by the SHA-256
  of its bytes: one file however many saves and sessions hold it, so a sidecar stays small to list,
  and a copy that went missing or changed is told by its name, never shown to the model in its
  place. A file goes when no sidecar names it any more.
* `sysprompt.kv`: the system prompt's state (reason AGENT_SYSTEM), reused while its key, the system
  prompt's text, is unchanged.

The id is stable across saves: a hash of the first prompt and the creation time. Each save replaces
the session's previous KV file. A file that cannot be used (damaged, another model's, another
context) is listed with the reason and never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.agent.transcript import Transcript, TranscriptError
from dwarfstar.errors import DwarfStarError
from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import FileHeader, KVFileError, ModelIdentity
from dwarfstar.kvcache.kvpolicy import MIB, SaveReason
from dwarfstar.kvcache.kvstore import tokens_key
from dwarfstar.kvcache.payload import PayloadError
from dwarfstar.kvcache.payloads import AnyArgs, AnyState, check_compatible, payload_nbytes, read_payload, write_payload
from dwarfstar.prompt.images import ImageError, keep_image, kept_image
from dwarfstar.tokenizer.tokenizer import Tokenizer

ENV_DIR = "DWARFSTAR_KVCACHE"
SYSPROMPT = "sysprompt.kv"
META_PREFIX = "agent-"
IMAGES = "agent-images"
ID_CHARS = 16
SHOWN_ID = 8


def default_directory() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".dwarfstar" / "kvcache")


def session_id(first_prompt: str, created: float) -> str:
    return hashlib.sha1(f"{created:.6f}\0{first_prompt}".encode()).hexdigest()[:ID_CHARS]


class SessionError(DwarfStarError):
    """A session that cannot be found, loaded or written."""


@dataclass
class SavedSession:
    """One sidecar as listed: `problem` says why it cannot be switched to (None: it can)."""

    id: str
    title: str
    created: float
    updated: float
    tokens: int
    kv_bytes: int
    kv_name: str | None  # None: stripped
    problem: str | None = None

    def age(self, now: float) -> str:
        seconds = max(0, int(now - self.updated))
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
            if seconds >= size:
                return f"{seconds // size}{unit}"
        return f"{seconds}s"

    def line(self, now: float) -> str:
        size = "stripped" if self.kv_name is None else f"{self.kv_bytes / MIB:.1f} MiB"
        line = (
            f"  {self.id[:SHOWN_ID]} ({self.age(now)} ago) {self.title or '(untitled)'}  [{self.tokens} tokens, {size}]"
        )
        return line + (f"  UNUSABLE: {self.problem}" if self.problem else "")


class SessionStore:
    def __init__(
        self, directory: Path, args: AnyArgs, identity: ModelIdentity, ctx: int, chunk: int, tokenizer: Tokenizer,
        new_state: Callable[[], AnyState], steering: str | None = None,
    ) -> None:  # fmt: skip
        """`steering`: the running engine's steering setting (`steering_tag`), None without: a state
        computed under one setting is never loaded under another."""
        self.directory, self.args, self.identity = Path(directory), args, identity
        self.ctx, self.chunk, self.tokenizer, self.new_state = ctx, chunk, tokenizer, new_state
        self.steering = steering
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SessionError(f"cannot create the session directory {self.directory}: {exc.strerror}") from None

    # -- listing ----------------------------------------------------------------------------------
    def sessions(self) -> list[SavedSession]:
        """Every sidecar, most recently saved first; the unusable ones say why."""
        found = [self._describe(path) for path in self.directory.glob(f"{META_PREFIX}*.json")]
        return sorted(found, key=lambda s: s.updated, reverse=True)

    def _describe(self, path: Path) -> SavedSession:
        sid = path.stem.removeprefix(META_PREFIX)
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            listed = SavedSession(
                sid, str(meta["title"]), float(meta["created"]), float(meta["updated"]), int(meta["tokens"]), 0,
                meta["kv"],
            )  # fmt: skip
            Transcript.from_json(meta["transcript"], self._read_image)
        except SessionError as exc:  # an image it names
            listed.problem = str(exc)
            return listed
        except (OSError, ValueError, KeyError, TypeError, TranscriptError) as exc:
            mtime = path.stat().st_mtime if path.exists() else 0.0
            return SavedSession(sid, "", mtime, mtime, 0, 0, None, f"unreadable session file ({exc})")
        if meta.get("steering") != self.steering:
            saved, now = meta.get("steering") or "off", self.steering or "off"
            listed.problem = f"saved with steering {saved}; this agent runs with steering {now}"
        elif listed.kv_name is not None:
            listed.problem = self._kv_problem(self.directory / listed.kv_name)
            listed.kv_bytes = (self.directory / listed.kv_name).stat().st_size if listed.problem is None else 0
        return listed

    def _kv_problem(self, path: Path) -> str | None:
        try:
            head = kvfile.read_head(path)
        except FileNotFoundError:
            return "its KV file is missing"
        except (KVFileError, OSError) as exc:
            return f"KV file: {exc}"
        if head.fingerprint is None:
            return "KV file has no DwarfStar identity (written by ds4 or another engine)"
        if head.fingerprint != self.identity.fingerprint:
            return "KV file was written for another model"
        try:
            check_compatible(head.payload, self.args, self.ctx, self.chunk)
        except PayloadError as exc:
            return f"KV file: {exc}"
        return None

    def find(self, prefix: str) -> SavedSession:
        if not prefix:
            raise SessionError("give a session id (or its first characters); /list shows them")
        matches = [s for s in self.sessions() if s.id.startswith(prefix)]
        if not matches:
            raise SessionError(f"no session {prefix!r}; /list shows them")
        if len(matches) > 1:
            raise SessionError(f"{prefix!r} matches {len(matches)} sessions; give more characters")
        return matches[0]

    # -- save / load ------------------------------------------------------------------------------
    def save(self, sid: str, created: float, transcript: Transcript, state: AnyState) -> SavedSession:
        """Write the state, the images and the sidecar; the session's older KV file goes, and so do the
        images no sidecar names any more (a compaction dropped their turns)."""
        old = self._meta_or_none(sid)
        key = self._key(state.tokens)
        name = hashlib.sha1(key + (self.steering or "").encode()).hexdigest() + ".kv"
        self._write_kv(self.directory / name, key, state, SaveReason.AGENT_SESSION)
        images = [self._write_image(part.data) for part in transcript.images]
        now = time.time()
        meta = {
            "title": transcript.title,
            "created": created,
            "updated": now,
            "tokens": len(state.tokens),
            "kv": name,
            "steering": self.steering,
            "transcript": transcript.to_json(),
            "images": sorted(set(images)),
        }
        self._write_json(sid, meta)
        if old and old.get("kv") not in (None, name) and not self._shared(old["kv"], sid):
            (self.directory / old["kv"]).unlink(missing_ok=True)
        self._drop_images(set(old.get("images", [])) - set(images) if old else set())
        return self._describe(self._meta_path(sid))

    def load(self, prefix: str) -> tuple[SavedSession, Transcript, AnyState | None]:
        """The session's transcript and state (None when stripped: the caller rebuilds it by prefill)."""
        listed = self.find(prefix)
        if listed.problem:
            raise SessionError(f"session {listed.id[:SHOWN_ID]} cannot be used: {listed.problem}")
        meta = self._meta_or_none(listed.id)
        transcript = Transcript.from_json(meta["transcript"], self._read_image)
        if listed.kv_name is None:
            return listed, transcript, None
        return listed, transcript, self._read_kv(self.directory / listed.kv_name, expected_key=None)

    def delete(self, prefix: str) -> SavedSession:
        listed = self.find(prefix)
        meta = self._meta_or_none(listed.id)
        if listed.kv_name and not self._shared(listed.kv_name, listed.id):
            (self.directory / listed.kv_name).unlink(missing_ok=True)
        self._meta_path(listed.id).unlink(missing_ok=True)
        self._drop_images(set(meta.get("images", [])) if meta else set())
        return listed

    def strip(self, prefix: str) -> SavedSession:
        listed = self.find(prefix)
        meta = self._meta_or_none(listed.id)
        if meta is None:
            raise SessionError(f"session {listed.id[:SHOWN_ID]} cannot be stripped: {listed.problem}")
        if meta["kv"] and not self._shared(meta["kv"], listed.id):
            (self.directory / meta["kv"]).unlink(missing_ok=True)
        meta["kv"] = None
        self._write_json(listed.id, meta)
        return self._describe(self._meta_path(listed.id))

    # -- the system prompt ------------------------------------------------------------------------
    def load_system(self, ids: list[int]) -> AnyState | None:
        """sysprompt.kv's state if it holds exactly these tokens (else None: prefill and save_system)."""
        path = self._system_path()
        if not path.exists():
            return None
        try:
            state = self._read_kv(path, expected_key=self._key(ids))
        except SessionError:
            return None
        return state if state.tokens == ids else None

    def save_system(self, state: AnyState) -> None:
        self._write_kv(self._system_path(), self._key(state.tokens), state, SaveReason.AGENT_SYSTEM)

    def _system_path(self) -> Path:
        """sysprompt.kv, or a steered engine's own copy (its state differs from the unsteered one)."""
        if self.steering is None:
            return self.directory / SYSPROMPT
        tag = hashlib.sha1(self.steering.encode()).hexdigest()[:12]
        return self.directory / SYSPROMPT.replace(".kv", f"-steered-{tag}.kv")

    def _key(self, tokens: list[int]) -> bytes:
        """The KV file's key of a state holding `tokens`, as the server's disk cache writes it."""
        return tokens_key(self.tokenizer.decode_bytes, self.tokenizer.vocab_size, tokens)

    # -- images -----------------------------------------------------------------------------------
    def _image_path(self, sha: str) -> Path:
        return self.directory / IMAGES / sha

    def _write_image(self, data: bytes) -> str:
        """Keep an image's bytes (once); returns its name."""
        try:
            return keep_image(self.directory / IMAGES, data)
        except ImageError as exc:
            raise SessionError(str(exc)) from None

    def _read_image(self, sha: str) -> bytes:
        """A saved image's bytes, checked against its name (transcript.ImageReader)."""
        try:
            return kept_image(self.directory / IMAGES, sha)
        except ImageError as exc:
            raise SessionError(f"its {exc}") from None

    def _drop_images(self, names: set[str]) -> None:
        """Remove the images among `names` that no sidecar names."""
        held = set()
        for path in self.directory.glob(f"{META_PREFIX}*.json"):
            held.update((self._meta_or_none(path.stem.removeprefix(META_PREFIX)) or {}).get("images", []))
        for sha in names - held:
            self._image_path(sha).unlink(missing_ok=True)

    # -- files ------------------------------------------------------------------------------------
    def _meta_path(self, sid: str) -> Path:
        return self.directory / f"{META_PREFIX}{sid}.json"

    def _meta_or_none(self, sid: str) -> dict | None:
        try:
            return json.loads(self._meta_path(sid).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _shared(self, kv_name: str, sid: str) -> bool:
        """Another session points at the same KV file (two sessions that hold the same tokens)."""
        for path in self.directory.glob(f"{META_PREFIX}*.json"):
            meta = self._meta_or_none(path.stem.removeprefix(META_PREFIX)) if path != self._meta_path(sid) else None
            if meta and meta.get("kv") == kv_name:
                return True
        return False

    def _write_json(self, sid: str, meta: dict) -> None:
        self._replace(self._meta_path(sid), json.dumps(meta, ensure_ascii=False, indent=1).encode())

    @staticmethod
    def _replace(path: Path, data: bytes) -> None:
        """Write `path` whole or not at all (a temporary file renamed into place)."""
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SessionError(f"cannot write {path}: {exc.strerror}") from None

    def _write_kv(self, path: Path, key: bytes, state: AnyState, reason: SaveReason) -> None:
        n = len(state.tokens)
        now = int(time.time())
        header = FileHeader(
            quant_bits=self.identity.quant_bits, reason=int(reason), ext_flags=0, tokens=n, hits=0, ctx=self.ctx,
            crc=0, created=now, last_used=now, payload_bytes=payload_nbytes(self.args, n), key_len=0,
        )  # fmt: skip
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                kvfile.write_checkpoint(
                    f, header, key, lambda out: write_payload(out, state, self.args, self.ctx, self.chunk), b"",
                    self.identity.fingerprint,
                )  # fmt: skip
            os.replace(tmp, path)
        except (OSError, PayloadError) as exc:
            tmp.unlink(missing_ok=True)
            raise SessionError(f"cannot save {path.name}: {exc}") from None

    def _read_kv(self, path: Path, expected_key: bytes | None) -> AnyState:
        try:
            ckpt = kvfile.read_checkpoint(path)
            if expected_key is not None and ckpt.key != expected_key:
                raise SessionError(f"{path.name} holds another prompt")
            return read_payload(ckpt.payload, self.args, self.ctx, self.chunk, self.new_state)
        except (KVFileError, PayloadError, OSError) as exc:
            raise SessionError(f"cannot load {path.name}: {exc}") from None
