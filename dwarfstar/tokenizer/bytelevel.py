"""GPT-2 byte-level alphabet: the printable character that stands for each byte in BPE token strings."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache


@cache
def byte_to_char() -> tuple[str, ...]:
    """Character for each byte 0..255: printable Latin-1 bytes stand for themselves, the rest move to U+0100+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = [""] * 256
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return tuple(table)


@cache
def char_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in enumerate(byte_to_char())}


def token_bytes_table(tokens: Sequence[str], added: Sequence[bool]) -> list[bytes]:
    """Raw bytes of every token: byte-level strings are mapped back, added tokens are their UTF-8 text.

    A character outside the byte alphabet in a normal token (never seen in DeepSeek's vocabulary) is
    kept as its own UTF-8 bytes rather than rejected, so a slightly odd GGUF still decodes.
    """
    back = char_to_byte()
    table: list[bytes] = []
    for text, is_added in zip(tokens, added, strict=True):
        if is_added:
            table.append(text.encode("utf-8"))
            continue
        try:
            table.append(bytes(back[char] for char in text))
        except KeyError:
            table.append(b"".join(bytes([back[c]]) if c in back else c.encode("utf-8") for c in text))
    return table
