"""Which Engram table rows a token looks up (issue 33; the facts: DeepSeek V4.1's `inference/engram.py`
as its ports and ds4's `ds4_engram.c` restate them; sources: shared/spec/RELEASES_2026.md).

- **Compressed ids.** Each token id maps to one of about 99k compressed ids (`compressed_token_map`):
  its text, normalised (NFKC, NFD, accents stripped, lower case, runs of spaces, tabs and line ends
  made one space, stripped, a lone space kept), numbered by first appearance; a token that is a
  partial UTF-8 character keeps its own vocabulary string. ds4 stores the map in the GGUF.
- **N-grams.** At position p, the compressed ids of p, p-1, p-2, p-3; once the look-back meets the
  sequence's start or an image position, that shift and every longer one read the pad id instead
  (the compressed id of token 2).
- **Hash.** Per Engram layer, one odd multiplier per shift (`engram_multipliers`); the 2-, 3- and
  4-gram hashes are the XOR of the shifts' id × multiplier. Each n-gram size has 8 heads, each with
  its own prime (`engram_primes`: the next 24 primes past 16M per layer, the layers' sets disjoint);
  a head's row is the hash modulo its prime plus the head's offset in the table (the primes' running
  sum). So a token looks up 24 rows per layer, whatever came before it, from its own ids alone:
  a whole prompt's rows are known before the model runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Regex, normalizers

from dwarfstar.errors import DwarfStarError
from dwarfstar.tokenizer.tokenizer import Tokenizer

SHIFTS = 4  # look-back 0..3: 2-, 3- and 4-grams
HEADS = 8  # primes per n-gram size
COLUMNS = (SHIFTS - 1) * HEADS  # rows a token looks up per layer
PRIME_START = 16_000_000
PAD_TOKEN = 2  # the token whose compressed id stands for "no token here"
MULTIPLIER_SEED = 10007  # layer L's multipliers: np.random.default_rng(10007 * L)
_SENTINEL = "\ue000"  # keeps a lone space through the strip


def _normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: Tokenizer) -> np.ndarray:
    """Each token id's compressed id (uint32 [vocab_size]), numbered by first appearance of its key."""
    normalise = _normalizer().normalize_str
    keys: dict[str, int] = {}
    out = np.empty(tokenizer.vocab_size, dtype=np.uint32)
    for token in range(tokenizer.vocab_size):
        text = tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        if "\ufffd" in text:
            key = tokenizer.piece(token)  # a partial character: the vocabulary string itself
        else:
            key = normalise(text) or text
        out[token] = keys.setdefault(key, len(keys))
    return out


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


def engram_primes(layers: Sequence[int], start: int = PRIME_START) -> dict[int, np.ndarray]:
    """Each Engram layer's 24 primes, in column order (n-gram size, then head): for each layer and
    n-gram size, 8 times the smallest prime past `start`'s search that no column took yet (so each
    layer's are the next 24 primes past those of the layers before it)."""
    used: set[int] = set()
    primes = {}
    for layer in layers:
        mine = []
        for _ in range(SHIFTS - 1):
            candidate = start - 1
            for _ in range(HEADS):
                candidate += 1
                while candidate in used or not _is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                mine.append(candidate)
        primes[layer] = np.array(mine, dtype=np.int64)
    return primes


def engram_multipliers(layer: int, compressed_vocab: int) -> np.ndarray:
    """Layer `layer`'s multiplier per look-back shift (int64 [4]): odd, and small enough that any
    compressed id times one fits in int64 (drawn by NumPy's PCG64 stream, as the reference draws them)."""
    bound = (2**63 - 1) // compressed_vocab // 2
    draws = np.random.default_rng(MULTIPLIER_SEED * layer).integers(0, bound, size=SHIFTS, dtype=np.int64)
    return draws * 2 + 1


@dataclass(frozen=True)
class EngramHash:
    """The lookup tables of a model's Engram layers: `token_map` (token id -> compressed id) and, per
    layer, its multipliers [4] and primes [24]."""

    token_map: np.ndarray
    multipliers: dict[int, np.ndarray]
    primes: dict[int, np.ndarray]

    def __post_init__(self) -> None:
        for layer, primes in self.primes.items():
            if primes.shape != (COLUMNS,) or self.multipliers.get(layer, np.empty(0)).shape != (SHIFTS,):
                raise DwarfStarError(f"Engram layer {layer} needs {COLUMNS} primes and {SHIFTS} multipliers")

    @property
    def pad(self) -> int:
        return int(self.token_map[PAD_TOKEN])

    def table_rows(self, layer: int) -> int:
        """The rows of `layer`'s table: one range per column, a prime's worth each."""
        return int(self.primes[layer].sum())

    def offsets(self, layer: int) -> np.ndarray:
        primes = self.primes[layer]
        return np.concatenate([[0], np.cumsum(primes)[:-1]])

    def rows(self, layer: int, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """The table rows (int64 [len(tokens) - start, 24]) that positions `start`.. of the sequence
        `tokens` (all of it so far: the look-back reads up to 3 positions before `start`) look up in
        `layer`. Ids past the vocabulary are image positions, which the look-back does not cross."""
        vocab = self.token_map.size
        begin = max(0, start - (SHIFTS - 1))  # the look-back reaches this far before `start`
        window = np.asarray(tokens[begin:], dtype=np.int64)
        image = window >= vocab
        compressed = np.where(image, -1, self.token_map[np.where(image, 0, window)].astype(np.int64))
        at = np.arange(start - begin, len(window))  # the positions asked for, as indices into `window`
        multipliers, primes, offsets = self.multipliers[layer], self.primes[layer], self.offsets(layer)
        blocked = np.zeros(at.size, dtype=bool)
        out = np.empty((at.size, COLUMNS), dtype=np.int64)
        h = np.zeros(at.size, dtype=np.int64)
        for shift in range(SHIFTS):
            src = at - shift  # negative only where `begin` is 0: before the sequence's first token
            ids = compressed[np.maximum(src, 0)]
            blocked |= (src < 0) | (ids < 0)  # once blocked, every longer look-back reads the pad
            t = np.where(blocked, self.pad, ids)
            h ^= t * multipliers[shift]  # the unigram's hash, then the 2-, 3- and 4-gram's
            if shift:
                cols = slice((shift - 1) * HEADS, shift * HEADS)
                out[:, cols] = h[:, None] % primes[cols] + offsets[cols]
        return out
