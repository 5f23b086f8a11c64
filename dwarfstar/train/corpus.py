"""The nano model's corpus: a text split into training text and a held-out tail, and training samples.

Samples come in the two forms the model meets at run time: plain text after BOS (`--prompt-tokens`,
perplexity runs) and a one-turn chat, `BOS <User> words <Assistant> </think>` followed by the text
that comes next in the book (`dwarfstar run -p`), so a chat prompt is answered by continuing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import regex

from dwarfstar.prompt.render import render_conversation
from dwarfstar.tokenizer.tokenizer import Tokenizer

HELDOUT_FRACTION = 0.05
_WORD = regex.compile(r"\p{L}+")
# a chat prompt starts at a sentence or clause start and takes this many words of the book
_PROMPT_START = regex.compile(r"(?:^|[.;:!?]\s+|\n\s*)(?=\p{Lu})", regex.MULTILINE)
PROMPT_WORDS = (2, 24)


@dataclass(frozen=True)
class Split:
    train: str
    heldout: str


def split_text(text: str, heldout_fraction: float = HELDOUT_FRACTION) -> Split:
    """Hold out the tail of the text, cut at the first paragraph break after the split point."""
    cut = text.find("\n\n", int(len(text) * (1 - heldout_fraction)))
    if cut < 0:
        raise ValueError("the corpus has no paragraph break near its end to cut the held-out slice at")
    return Split(train=text[:cut], heldout=text[cut:].lstrip("\n"))


def read_split(path: str | Path) -> Split:
    return split_text(Path(path).read_text(encoding="utf-8"))


def word_list(text: str) -> set[str]:
    """The lower-cased words (runs of letters) of a text."""
    return {w.lower() for w in _WORD.findall(text)}


def chat_prompts(text: str, n: int, seed: int) -> list[tuple[str, int]]:
    """`n` user turns: a few words of the text from a sentence or clause start, each with the offset
    in `text` where it ends (the answer is what comes next)."""
    rng = np.random.default_rng(seed)
    starts = np.array([m.end() for m in _PROMPT_START.finditer(text)])
    prompts = []
    for start in rng.choice(starts, size=n):
        spans = []
        for match in _WORD.finditer(text, int(start)):
            spans.append(match)
            if len(spans) == PROMPT_WORDS[1]:
                break
        k = int(rng.integers(PROMPT_WORDS[0], PROMPT_WORDS[1] + 1))
        if len(spans) < k:
            continue
        end = spans[k - 1].end()
        prompts.append((" ".join(text[int(start) : end].split()), end))
    return prompts


def chat_samples(text: str, tokenizer: Tokenizer, n: int, length: int, seed: int) -> list[np.ndarray]:
    """`n` one-turn chats of `length` tokens: a few words of the text as the user turn, the rest as the answer."""
    samples = []
    for prompt, end in chat_prompts(text, n, seed):
        ids = tokenizer.encode_prompt(render_conversation([{"role": "user", "content": prompt}]).parts)
        answer_chars = length * 8  # far more text than `length` tokens need
        ids += tokenizer.encode(text[end : end + answer_chars].lstrip())
        if len(ids) >= length:
            samples.append(np.asarray(ids[:length], dtype=np.int64))
    return samples
