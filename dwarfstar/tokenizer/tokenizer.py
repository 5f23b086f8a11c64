"""The DeepSeek V4 byte-level BPE tokenizer, built from GGUF `tokenizer.ggml.*` metadata on HF `tokenizers`.

Two engines share one vocabulary:
- `plain` knows no added tokens, so any text (user input, files, tool results) is BPE only and can
  never produce a control token;
- `with_specials` also matches every added token (the official `tokenizer.json` behaviour), for
  pre-rendered prompt files whose control tokens are written out as text.

Long texts are cut after a newline that is followed by a non-space character and encoded as a
parallel batch (tokenizers is also faster on many short inputs than on one huge one). Those cuts are
piece boundaries of all three pre-tokenizer regexes (no match can cross them), so the ids are exactly
those of a single encode; only the speed differs.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import regex
from tokenizers import Tokenizer as Engine
from tokenizers import decoders, models

from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.tokenizer import specials
from dwarfstar.tokenizer.bytelevel import token_bytes_table
from dwarfstar.tokenizer.pretokenize import pre_tokenizer_for
from dwarfstar.tokenizer.specials import Control, PromptPart

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4
ADDED_TOKEN_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED)

# Texts longer than this are cut into about this many characters per batch item.
CHUNK_CHARS = 1 << 15
_SAFE_CUT = regex.compile(r"\n(?=\P{White_Space})")
_SURROGATE = regex.compile(r"[\ud800-\udfff]")


class TokenizerError(DwarfStarError):
    """Token ids or text the tokenizer cannot handle (for example an id outside the vocabulary)."""


def split_at_safe_cuts(text: str, chunk_chars: int) -> list[str]:
    """Cut `text` into pieces of at least `chunk_chars` characters, each ending at a safe cut."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > chunk_chars:
        cut = _SAFE_CUT.search(text, start + chunk_chars)
        if cut is None:
            break
        pieces.append(text[start : cut.end()])
        start = cut.end()
    pieces.append(text[start:])
    return pieces


def _as_list(value: Any, key: str) -> list:
    if value is None:
        raise ModelFileError(f"GGUF metadata has no {key}; the file carries no tokenizer")
    return list(value)


class Tokenizer:
    """Encode text to DeepSeek V4 token ids and decode ids back to text or bytes."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str | None):
        if len(token_types) != len(tokens):
            raise ModelFileError(f"tokenizer has {len(tokens)} tokens but {len(token_types)} token types")
        self._tokens = list(tokens)
        self._pre = pre
        added = [t in ADDED_TOKEN_TYPES for t in token_types]
        self._added_ids = {text: i for i, (text, is_added) in enumerate(zip(tokens, added, strict=True)) if is_added}
        self._added = frozenset(self._added_ids.values())
        vocab: dict[str, int] = {}
        for i, (text, is_added) in enumerate(zip(tokens, added, strict=True)):
            if not is_added:
                vocab.setdefault(text, i)  # first id wins if a padded vocabulary repeats a string
        self._vocab = vocab
        self._merges = [self._merge_pair(m) for m in merges]
        self._control = {i for i, t in enumerate(token_types) if t == TOKEN_CONTROL}
        self._bytes = token_bytes_table(self._tokens, added)
        self.plain = self._engine()

    @staticmethod
    def _merge_pair(merge: str) -> tuple[str, str]:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ModelFileError(f"malformed tokenizer merge {merge!r}; expected two tokens separated by a space")
        return left, right

    def _engine(self) -> Engine:
        engine = Engine(models.BPE(vocab=self._vocab, merges=self._merges, fuse_unk=False, byte_fallback=False))
        engine.pre_tokenizer = pre_tokenizer_for(self._pre)
        engine.decoder = decoders.ByteLevel()
        return engine

    @cached_property
    def with_specials(self) -> Engine:
        # tokenizers keeps an added token's id only if the BPE vocabulary already maps its string to that
        # id (otherwise it renumbers them after the vocabulary), so, as in the official tokenizer.json, the
        # added strings go into the vocabulary too. BPE cannot produce them: no merge builds these strings.
        spec = json.loads(self.plain.to_str())
        spec["model"]["vocab"].update(self._added_ids)
        spec["added_tokens"] = [
            {
                "id": tid,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": tid in self._control,
            }
            for text, tid in sorted(self._added_ids.items(), key=lambda item: item[1])
        ]
        return Engine.from_str(json.dumps(spec))

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from plain GGUF metadata values (`tokenizer.ggml.tokens` as a list of str, ...)."""
        model = meta.get("tokenizer.ggml.model", "gpt2")
        if model != "gpt2":
            raise ModelFileError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
        tokens = _as_list(meta.get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")
        merges = _as_list(meta.get("tokenizer.ggml.merges"), "tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type")
        token_types = [int(t) for t in types] if types is not None else [1] * len(tokens)
        return cls(tokens, merges, token_types, meta.get("tokenizer.ggml.pre"))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        from dwarfstar.gguf.reader import GGUFFile

        with GGUFFile(path) as gguf:
            return cls.from_gguf_metadata(gguf.metadata)

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike, vocab_size: int) -> Tokenizer:
        """Build through the same GGUF keys a converted model would carry (no GGUF file needed)."""
        from dwarfstar.tokenizer.vocab import tokenizer_metadata

        plain: dict[str, Any] = {}
        for key, (value_type, value) in tokenizer_metadata(Path(path), vocab_size).items():
            plain[key] = value[1] if value_type == ValueType.ARRAY else value  # arrays are (item type, items)
        return cls.from_gguf_metadata(plain)

    # -- vocabulary ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_id(self, text: str) -> int:
        """Id of a token by its vocabulary string (added tokens first, then BPE pieces)."""
        tid = self._added_ids.get(text, self._vocab.get(text))
        if tid is None:
            raise ModelFileError(f"the tokenizer vocabulary has no token {text!r}")
        return tid

    @cached_property
    def bos_id(self) -> int:
        return self.token_id(specials.BOS)

    @cached_property
    def eos_id(self) -> int:
        return self.token_id(specials.EOS)

    def piece(self, token_id: int) -> str:
        """The token's vocabulary string (byte-level alphabet for BPE pieces), as ds4's --dump-tokens prints it."""
        return self._tokens[self._checked(token_id)]

    @property
    def added_ids(self) -> frozenset[int]:
        """The ids of every control and user-defined token."""
        return self._added

    def is_added(self, token_id: int) -> bool:
        """True for control and user-defined tokens (the ones plain text never produces)."""
        return self._checked(token_id) in self._added

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[self._checked(token_id)]

    def _checked(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return token_id

    # -- encoding --------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain-text ids: nothing in `text` becomes a control token."""
        return self._encode_many(self.plain, [text])[0]

    def encode_with_specials(self, text: str) -> list[int]:
        """Ids with every added-token string in `text` matched as that token (official tokenizer.json rules)."""
        return self._encode_many(self.with_specials, [text])[0]

    def encode_bytes(self, data: bytes) -> list[int]:
        """Plain-text ids of raw bytes; invalid UTF-8 becomes U+FFFD, as when a text file is read."""
        return self.encode(data.decode("utf-8", errors="replace"))

    def encode_prompt(self, parts: Iterable[PromptPart]) -> list[int]:
        """Ids of a rendered prompt: `Control` parts are one token each, text runs are plain BPE."""
        runs: list[str | int] = []
        for part in parts:
            if isinstance(part, Control):
                runs.append(self.token_id(part.text))
            elif runs and isinstance(runs[-1], str):
                runs[-1] += part  # adjacent text is one run: a cut between them could change the pieces
            else:
                runs.append(part)
        texts = [run for run in runs if isinstance(run, str)]
        encoded = iter(self._encode_many(self.plain, texts))
        ids: list[int] = []
        for run in runs:
            if isinstance(run, str):
                ids.extend(next(encoded))
            else:
                ids.append(run)
        return ids

    def _encode_many(self, engine: Engine, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts in one parallel batch, cutting long ones at safe cuts."""
        pieces: list[str] = []
        counts: list[int] = []
        for text in texts:
            cut = split_at_safe_cuts(text, CHUNK_CHARS) if len(text) > CHUNK_CHARS else [text]
            pieces.extend(cut)
            counts.append(len(cut))
        try:
            encodings = engine.encode_batch(pieces, add_special_tokens=False)
        except TypeError:
            # Lone surrogates cannot cross into Rust; they are invalid text, replaced like invalid UTF-8 bytes.
            pieces = [_SURROGATE.sub("\ufffd", piece) for piece in pieces]
            encodings = engine.encode_batch(pieces, add_special_tokens=False)
        flat = iter(encodings)
        return [list(itertools.chain.from_iterable(e.ids for e in itertools.islice(flat, n))) for n in counts]

    # -- decoding --------------------------------------------------------------------------------------------
    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        if ids and (min(ids) < 0 or max(ids) >= len(self._bytes)):
            bad = next(i for i in ids if not 0 <= i < len(self._bytes))
            raise TokenizerError(f"token id {bad} is outside the vocabulary (0..{len(self._bytes) - 1})")
        table = self._bytes
        return b"".join([table[i] for i in ids])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, control tokens included as their strings; broken UTF-8 becomes U+FFFD."""
        return self.decode_bytes(list(ids)).decode("utf-8", errors="replace")
