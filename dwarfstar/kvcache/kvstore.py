"""The disk KV cache: a directory of `<sha1 of key>.kv` checkpoints (kvfile.py) under a byte budget.

Saving writes `<name>.tmp.<pid>`, fsyncs it, renames it into place and fsyncs the directory, so a
crash leaves either the old state or the whole new file; a partial file never carries a valid
checksum, and leftover temporary files of dead processes are removed when the cache opens. Lookup
picks, among the files this model can load, the longest key that is a byte prefix of the prompt's
rendered text, reads it with plain reads, verifies the checksum and rebuilds the sequence state (in
the layout of the model's family: payloads.py).
A corrupt or truncated file is logged and removed; a foreign one (another model, context, chunk
size, engine, or quant when `strict_quant` is set) is logged with the reason and left for whoever
owns it. No failure of the cache reaches the session: saves return None, lookups miss.
What is kept when space runs out is kvpolicy.py's business; eviction also runs on open.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import CorruptFile, FileHeader, ForeignFile, KVFileError, ModelIdentity
from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason, plan_eviction, superseded
from dwarfstar.kvcache.payload import PayloadError
from dwarfstar.kvcache.payloads import (
    AnyArgs,
    AnyState,
    check_compatible,
    host_states,
    payload_nbytes,
    read_payload,
    write_payload,
)

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[0-9a-f]{40}\.kv$")
_TMP = re.compile(r"^[0-9a-f]{40}\.kv\.tmp\.(\d+)$")


@dataclass
class Entry:
    """A parsed file in the directory; `refusal` says why this store cannot load it (None: it can)."""

    path: Path
    header: FileHeader
    key: bytes
    size: int
    stamp: tuple[int, int]  # (size, mtime_ns) when parsed, to notice a file replaced under us
    refusal: str | None = None

    # the fields kvpolicy.CachedFile asks for
    @property
    def tokens(self) -> int:
        return self.header.tokens

    @property
    def hits(self) -> int:
        return self.header.hits

    @property
    def last_used(self) -> int:
        return self.header.last_used or self.header.created

    @property
    def reason(self) -> int:
        return self.header.reason


@dataclass
class _Incoming:
    key: bytes
    tokens: int
    size: int
    last_used: int
    reason: int
    hits: int = 0


@dataclass(eq=False)
class StateImage:
    """What a save writes: a state's tokens and a writer of its payload. A frozen image holds the
    payload bytes as they were when it was made, so the live state goes on (and may be cut back)
    while a writer thread stores the copy; an unfrozen one writes from the state itself."""

    tokens: list[int]
    write_payload: Callable[[BinaryIO], int]
    payload: memoryview | None = None  # the bytes of a frozen image
    key: bytes | None = None  # the decoded text of the tokens, once someone needed it


@dataclass
class PlannedSave:
    path: Path
    header: FileHeader | None  # None: the same checkpoint is already stored, nothing to write
    key: bytes
    image: StateImage
    ktm: bytes


@dataclass
class CacheHit:
    state: AnyState
    key: bytes  # the rendered prefix the state covers; the caller tokenizes the rest of the prompt
    tool_map: dict[str, str]
    path: Path
    reason: SaveReason
    key_flags: int  # EXT_RESPONSES_VISIBLE / EXT_THINKING_VISIBLE when keyed by a visible transcript

    @property
    def n_tokens(self) -> int:
        return len(self.state.tokens)


def tokens_key(decode_bytes: Callable[[Sequence[int]], bytes], vocab_size: int, tokens: Sequence[int]) -> bytes:
    """The key of a state holding `tokens`, matched as a byte prefix of a request's key: their text
    (`decode_bytes`), each image id among them (past the vocabulary: model/image_spans.py) written as
    the byte 0xFF, the id in hex, 0xFF. No UTF-8 text holds that byte, so a text request's key
    (its rendered text) never matches an image's; the key of a prefix is a prefix of the key, and two
    images differ in it as in their ids."""
    tokens = list(tokens)
    if max(tokens, default=0) < vocab_size:
        return decode_bytes(tokens)
    out = bytearray()
    for image, group in itertools.groupby(tokens, key=lambda t: t >= vocab_size):
        run = list(group)
        out += b"".join(b"\xff%x\xff" % t for t in run) if image else decode_bytes(run)
    return bytes(out)


@dataclass
class KVStore:
    directory: Path
    args: AnyArgs  # the model's, V4 or V4.1: its family picks the payload layout (payloads.py)
    identity: ModelIdentity
    ctx: int
    chunk: int
    render_key: Callable[[Sequence[int]], bytes]  # the key of tokens: their decoded text (`tokens_key`)
    options: KVCacheOptions = field(default_factory=KVCacheOptions)
    new_state: Callable[[], AnyState] | None = None  # the backend's; None: host float32 states
    clock: Callable[[], float] = time.time
    _index: dict[str, Entry] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._new_state = self.new_state or host_states(self.args, self.ctx)
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        self.evict()

    # -- the directory -------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every intact cache file, rescanned (other processes may share the directory)."""
        seen = {}
        try:
            listing = list(os.scandir(self.directory))
        except OSError as exc:
            log.warning("kv cache cannot list %s: %s", self.directory, exc)
            return []
        for dirent in listing:
            if not _NAME.match(dirent.name):
                continue
            try:
                st = dirent.stat()
            except FileNotFoundError:
                continue
            old = self._index.get(dirent.name)
            entry = old if old is not None and old.stamp == (st.st_size, st.st_mtime_ns) else self._parse(dirent, st)
            if entry is not None:
                seen[dirent.name] = entry
        self._index = seen
        return list(seen.values())

    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def _parse(self, dirent: os.DirEntry, st: os.stat_result) -> Entry | None:
        path = Path(dirent.path)
        try:
            head = kvfile.read_head(path)
        except CorruptFile as exc:
            self._remove(path, f"corrupt: {exc}")
            return None
        except ForeignFile as exc:
            log.info("kv cache ignores %s: %s", path.name, exc)
            return None
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kv cache cannot read %s: %s", path.name, exc)
            return None
        entry = Entry(path, head.header, head.key, st.st_size, (st.st_size, st.st_mtime_ns))
        entry.refusal = self._refusal(head)
        if entry.refusal:
            log.info("kv cache will not load %s: %s", path.name, entry.refusal)
        return entry

    def _refusal(self, head: kvfile.Head) -> str | None:
        if head.fingerprint is None:
            return "no DwarfStar identity section (written by ds4 or another engine)"
        try:
            check_compatible(head.payload, self.args, self.ctx, self.chunk)
        except PayloadError as exc:
            return str(exc)
        if head.fingerprint != self.identity.fingerprint:
            return f"written for another model (fingerprint {head.fingerprint.hex()[:12]}…)"
        if head.header.ctx > self.ctx:
            return f"written for context {head.header.ctx}, this cache serves {self.ctx}"
        bits = head.header.quant_bits
        if self.options.strict_quant and bits != self.identity.quant_bits:
            return f"routed experts at {bits} bits, this model has {self.identity.quant_bits} (strict quant)"
        return None

    def _remove(self, path: Path, why: str, level: int = logging.WARNING) -> None:
        log.log(level, "kv cache removes %s: %s", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("kv cache could not remove %s: %s", path.name, exc)
        self._index.pop(path.name, None)

    def _remove_stale_temporaries(self) -> None:
        for dirent in os.scandir(self.directory):
            m = _TMP.match(dirent.name)
            if m and not _process_alive(int(m.group(1))):
                self._remove(Path(dirent.path), "unfinished write of a process that is gone", logging.INFO)

    # -- lookup ---------------------------------------------------------------------------------------
    def lookup(self, prompt: bytes) -> CacheHit | None:
        """The longest loadable checkpoint whose key is a byte prefix of `prompt` (the rendered text)."""
        candidates = [
            e
            for e in self.entries()
            if e.refusal is None and e.tokens >= self.options.min_tokens and prompt.startswith(e.key)
        ]
        for entry in sorted(candidates, key=lambda e: (len(e.key), e.tokens), reverse=True):
            hit = self._load(entry)
            if hit is not None:
                return hit
        return None

    def _load(self, entry: Entry) -> CacheHit | None:
        try:
            ckpt = kvfile.read_checkpoint(entry.path)
            if ckpt.key != entry.key:
                raise CorruptFile("the file changed since it was scanned")
            state = read_payload(ckpt.payload, self.args, self.ctx, self.chunk, self._new_state)
        except (CorruptFile, PayloadError) as exc:
            self._remove(entry.path, f"corrupt: {exc}")
            return None
        except (ForeignFile, OSError) as exc:  # unreadable now is not proof of damage: keep it
            log.info("kv cache skips %s: %s", entry.path.name, exc)
            return None
        header = ckpt.header
        header.hits, header.last_used = header.hits + 1, int(self.clock())
        try:
            kvfile.touch(entry.path, header)
        except OSError as exc:  # a read-only or vanished file still served this hit
            log.warning("kv cache could not count the hit on %s: %s", entry.path.name, exc)
        self._index.pop(entry.path.name, None)
        log.info("kv cache hit tokens=%d key=%d bytes file=%s", header.tokens, len(ckpt.key), entry.path.name)
        flags = header.ext_flags & (kvfile.EXT_RESPONSES_VISIBLE | kvfile.EXT_THINKING_VISIBLE)
        return CacheHit(state, ckpt.key, ckpt.tool_map, entry.path, _known_reason(header.reason), flags)

    # -- save -----------------------------------------------------------------------------------------
    def save(
        self,
        state: AnyState,
        reason: SaveReason,
        tool_map: Mapping[str, str] | None = None,
        key: bytes | None = None,
        key_flag: int = 0,
        keep_prefixes_of: bytes | None = None,
    ) -> Path | None:
        """Store `state` as a checkpoint; None when skipped (too short, not worth its space, I/O error).

        `key` overrides the decoded token text (a visible transcript, with `key_flag` saying which);
        `tool_map` keeps the tool-call ids whose exact DSML appears in the key; files that are prefixes
        of `keep_prefixes_of` (the prompt about to be looked up) survive this save's eviction.
        """
        if not self._worth_a_file(state):
            return None
        image = StateImage(list(state.tokens), lambda out: write_payload(out, state, self.args, self.ctx, self.chunk))
        planned = self.plan_save(image, reason, tool_map, key, key_flag, keep_prefixes_of)
        return None if planned is None else self.write(planned)

    def _worth_a_file(self, state: AnyState) -> bool:
        n = len(state.tokens)
        if n < self.options.min_tokens or state.logits is None:
            log.info("kv cache skips a %d-token state (min %d)", n, self.options.min_tokens)
            return False
        return True

    def freeze(self, state: AnyState) -> StateImage | None:
        """The state's payload as of now, or None when it is not worth a file (too short, no logits)."""
        if not self._worth_a_file(state):
            return None
        out = io.BytesIO()
        write_payload(out, state, self.args, self.ctx, self.chunk)
        payload = out.getbuffer()
        return StateImage(list(state.tokens), lambda target: target.write(payload), payload)

    def key_of(self, image: StateImage) -> bytes:
        if image.key is None:
            image.key = self.render_key(image.tokens)
        return image.key

    def thaw(self, image: StateImage) -> AnyState:
        """A state rebuilt from a frozen image not yet written (a lookup that finds it still queued)."""
        return read_payload(image.payload, self.args, self.ctx, self.chunk, self._new_state)

    def plan_save(
        self,
        image: StateImage,
        reason: SaveReason,
        tool_map: Mapping[str, str] | None = None,
        key: bytes | None = None,
        key_flag: int = 0,
        keep_prefixes_of: bytes | None = None,
    ) -> PlannedSave | None:
        """Decide the file and make room for it (evictions happen here); None when it is not stored."""
        n = len(image.tokens)
        key = self.key_of(image) if key is None else key
        tools = {i: d for i, d in (tool_map or {}).items() if d.encode("utf-8", "surrogateescape") in key}
        ktm = kvfile.encode_tool_map(tools)
        path = self.directory / (hashlib.sha1(key).hexdigest() + ".kv")
        entries = self.entries()
        existing = self._index.get(path.name)  # a foreign file with this key is replaced, as ds4 does
        same = existing is not None and existing.refusal is None and existing.key == key
        if same and (not tools or self._has_tools(existing, tools)):
            return PlannedSave(path, None, key, image, ktm)  # the same checkpoint is there (ds4 keeps it too)
        others = [e for e in entries if e.path != path]
        now = int(self.clock())
        size = kvfile.FIXED.size + len(key) + payload_nbytes(self.args, n) + len(ktm) + kvfile.IDENTITY.size
        incoming = _Incoming(key, n, size, now, int(reason))
        stale = superseded(others, incoming)
        remaining = [e for e in others if not any(e is s for s in stale)]
        plan = plan_eviction(remaining, now, self.options, incoming, _prefixes_of(remaining, keep_prefixes_of))
        if not plan.admit:
            log.info("kv cache skips storing %d tokens (%s): it would not survive eviction", n, reason.name.lower())
            return None
        for victim in stale:
            self._remove(victim.path, "superseded by a longer checkpoint of the same conversation", logging.INFO)
        self._evict(plan.victims)
        header = FileHeader(
            quant_bits=self.identity.quant_bits, reason=int(reason), ext_flags=key_flag, tokens=n, hits=0,
            ctx=self.ctx, crc=0, created=now, last_used=now, payload_bytes=payload_nbytes(self.args, n), key_len=0,
        )  # fmt: skip
        if same:  # rewritten only to add tool ids: keep its history
            header.hits, header.created = existing.hits, existing.header.created
        return PlannedSave(path, header, key, image, ktm)

    def write(self, planned: PlannedSave) -> Path | None:
        """Write a planned checkpoint; touches no store state, so it may run outside the caller's lock."""
        if planned.header is None:
            return planned.path
        n, reason = planned.header.tokens, SaveReason(planned.header.reason)
        try:
            self._write_atomically(planned)
        except (OSError, PayloadError) as exc:
            log.warning("kv cache store of %d tokens failed: %s", n, exc)
            return None
        log.info("kv cache stored tokens=%d reason=%s file=%s", n, reason.name.lower(), planned.path.name)
        return planned.path

    def _has_tools(self, entry: Entry, tools: Mapping[str, str]) -> bool:
        try:
            stored = kvfile.read_tool_map(entry.path)
        except (KVFileError, OSError):
            return False
        return all(stored.get(i) == d for i, d in tools.items())

    def _write_atomically(self, planned: PlannedSave) -> None:
        path = planned.path
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                kvfile.write_checkpoint(
                    f, planned.header, planned.key, planned.image.write_payload, planned.ktm,
                    self.identity.fingerprint,
                )  # fmt: skip
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_directory(self.directory)

    # -- budget ---------------------------------------------------------------------------------------
    def evict(self, keep_prefixes_of: bytes | None = None) -> list[Path]:
        """Bring the directory under budget; returns the removed files."""
        entries = self.entries()
        plan = plan_eviction(entries, self.clock(), self.options, keep=_prefixes_of(entries, keep_prefixes_of))
        self._evict(plan.victims)
        return [v.path for v in plan.victims]

    def _evict(self, victims: list[Entry]) -> None:
        for v in victims:
            self._remove(v.path, f"evicted ({v.tokens} tokens, {v.hits} hits), cache full", logging.INFO)


def _known_reason(value: int) -> SaveReason:
    """A reason byte this engine does not know (a newer writer's) reads as UNKNOWN, not as an error."""
    try:
        return SaveReason(value)
    except ValueError:
        return SaveReason.UNKNOWN


def _prefixes_of(entries: list[Entry], prompt: bytes | None) -> list[Entry]:
    return [] if prompt is None else [e for e in entries if prompt.startswith(e.key)]


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # not writing yet: a leftover of an earlier process that had our pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; some platforms cannot open a directory, which only costs durability."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
