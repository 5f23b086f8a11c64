"""The bundled nano model's held-out book perplexity stays within 5% of 74.1, its figure before it
was trained on chat, thinking and tool-call turns (issue 19)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.train.corpus import read_split

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
BOOK_PERPLEXITY = 74.1  # README: the last 5% of the book, 512-token windows after BOS
EVAL_LEN = 512


def test_heldout_book_perplexity_stays_within_five_percent() -> None:
    """Measured as tools/train_nano.py measures it (each window starts a fresh sequence at BOS), here
    on the shipped file's own weights with the QAT rounding on, as they are served."""
    engine = load_engine(EngineSpec(default_model_path(), "reference"))
    model, tokenizer = engine.backend, engine.tokenizer
    ids = tokenizer.encode(read_split(CORPUS).heldout)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, EVAL_LEN):
        chunk = [tokenizer.bos_id, *ids[start : start + EVAL_LEN]]
        logits = model.forward(chunk[:-1], model.new_state())
        total += float(F.cross_entropy(logits.float(), torch.tensor(chunk[1:]), reduction="sum"))
        count += len(chunk) - 1
    perplexity = math.exp(total / count)
    print(f"held-out perplexity {perplexity:.2f} over {count} tokens")
    assert count == len(ids)  # every held-out token is predicted once
    assert perplexity <= BOOK_PERPLEXITY * 1.05
