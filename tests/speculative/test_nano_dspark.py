"""The bundled model with its trained DSpark drafter (dwarfstar/data/nano-dspark.gguf, `--dspark
bundled`): greedy speculation gives the plain greedy text over 200 tokens (crossing the raw window of
32 and position 128, where the ratio-128 layers emit a row) while drafts are accepted at every one of
the block's five positions; `--dspark bundled` names the bundled model's drafter only.

Without the QAT rounding, as in test_nano_greedy: a verifying pass and a one-token decode then agree
bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_support import first_gap

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.bundled import default_model_path
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import load_speculation
from dwarfstar.speculative.mtp_options import BUNDLED_DSPARK, DSparkOptions

N_TOKENS = 200
CTX = 512
BUNDLED = DSparkOptions(Path("bundled"))


def test_the_bundled_drafter_changes_nothing_and_its_drafts_are_accepted():
    engine = load_engine(EngineSpec(default_model_path(), "reference", ctx=CTX, qat=False))
    prompt = engine.tokenizer.encode("Quel ramo del lago di Como, che volge a mezzogiorno")
    session = Session(engine.backend, ctx=CTX)
    session.prefill(prompt)
    want = list(session.generate(N_TOKENS, GREEDY))
    spec = load_speculation(BUNDLED, engine.backend, engine.model).start(Session(engine.backend, ctx=CTX))
    spec.prefill(prompt)
    got = list(spec.generate(N_TOKENS, GREEDY))
    assert first_gap(got, want) is None and len(got) == N_TOKENS
    assert all(a > 0 for a in spec.stats.accepted[:5])  # drafts accepted at every position of the block
    assert spec.stats.mean_accepted > 0.5  # a random drafter of this shape accepts next to none


def test_bundled_names_the_bundled_models_drafter_only(tmp_path, tiny_model_file, monkeypatch):
    assert BUNDLED.file_for(default_model_path()) == default_model_path().with_name(BUNDLED_DSPARK)
    assert BUNDLED.file_for(default_model_path()).is_file()
    with pytest.raises(DwarfStarError, match="is the drafter of the bundled model; .* needs its own support file"):
        BUNDLED.file_for(tiny_model_file(0))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bundled").write_bytes(b"")  # a file of that name is the file
    assert BUNDLED.file_for(tiny_model_file(0)) == Path("bundled")
