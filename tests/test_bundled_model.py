"""The bundled nano model: it loads and validates, it is the default, and training shows.

The bounds are earned, not copied: the held-out perplexity must be under half that of the same
network at its initialisation and under half that of a unigram model of the training text (what a
model without any use of context could reach), and a greedy continuation must be Italian words.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import regex
import torch
import torch.nn.functional as F

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.loader import open_model
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session
from dwarfstar.train.corpus import Split, read_split, word_list
from dwarfstar.train.params import ParamWeights, init_params

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
MAX_BYTES = 40 * 1000 * 1000
HELDOUT_TOKENS = 384
PROMPT = "Quel ramo del lago di Como"
CONTINUATION_TOKENS = 24


@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_engine(EngineSpec(default_model_path(), "reference"))


@pytest.fixture(scope="module")
def split() -> Split:
    return read_split(CORPUS)


def perplexity(model: ReferenceModel, ids: list[int]) -> float:
    logits = model.forward(ids[:-1], model.new_state())
    return math.exp(float(F.cross_entropy(logits, torch.tensor(ids[1:]))))


def test_bundled_model_is_the_default_and_valid() -> None:
    path = default_model_path()
    assert path.is_file() and path.stat().st_size <= MAX_BYTES
    model = open_model(path)  # parses the metadata and validates every tensor
    try:
        args = model.args
        assert args.vocab_size == 129280
        assert {layer.compress_ratio for layer in args.layers} == {0, 4, 128}
        assert any(layer.hash_routed for layer in args.layers) and not all(layer.hash_routed for layer in args.layers)
        assert args.n_shared_experts >= 1 and args.hc_mult > 1
    finally:
        model.close()


def test_heldout_perplexity_is_far_below_untrained_and_unigram(engine: Engine, split: Split) -> None:
    tokenizer = engine.tokenizer
    ids = [tokenizer.bos_id, *tokenizer.encode(split.heldout)[:HELDOUT_TOKENS]]
    trained = perplexity(engine.backend, ids)

    untrained_model = ReferenceModel.from_weights(engine.model.args, ParamWeights(init_params(engine.model.args, 1)))
    untrained = perplexity(untrained_model, ids)

    counts = Counter(tokenizer.encode(split.train))
    total, vocab = sum(counts.values()), engine.model.args.vocab_size
    unigram = math.exp(-sum(math.log((counts[t] + 1) / (total + vocab)) for t in ids[1:]) / (len(ids) - 1))

    assert trained < 0.5 * untrained, (trained, untrained)
    assert trained < 0.5 * unigram, (trained, unigram)


def test_greedy_continuation_is_utf8_italian_words(engine: Engine, split: Split) -> None:
    tokenizer = engine.tokenizer
    session = Session(engine.backend)
    session.prefill([tokenizer.bos_id, *tokenizer.encode(PROMPT)])
    out = list(session.generate(CONTINUATION_TOKENS, GREEDY, stop_tokens=[engine.model.args.eos_token_id]))
    text = tokenizer.decode_bytes(out).decode("utf-8")  # raises on invalid UTF-8
    words = regex.findall(r"\p{L}+", text)
    if text and regex.match(r"\p{L}", text[-1]):
        words = words[:-1]  # the token budget may end inside a word
    assert len(words) >= 3, text
    known = word_list(split.train)
    assert all(w.lower() in known for w in words), (text, [w for w in words if w.lower() not in known])
