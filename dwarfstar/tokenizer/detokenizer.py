"""Streaming detokenization that never emits half a UTF-8 character.

Byte-level BPE splits multi-byte characters across tokens (an emoji is often three or four tokens),
so text is released only once its bytes form complete characters. Bytes that can never become a
valid character are released as U+FFFD as soon as that is certain, exactly where a one-shot
`bytes.decode("utf-8", "replace")` of the whole sequence would put them.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from dwarfstar.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Feed token ids one at a time (or in groups); get back the text they complete."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token; "" while a character is still partial."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def push_many(self, token_ids: Iterable[int]) -> str:
        return self._decoder.decode(b"".join(self._tokenizer.token_bytes(t) for t in token_ids))

    @property
    def pending_bytes(self) -> bytes:
        """Bytes of an unfinished character held back from the output."""
        return self._decoder.getstate()[0]

    def flush(self) -> str:
        """End of stream: a still-unfinished character becomes U+FFFD."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
