"""The MTP draft on the last stage of a split set: the stage maps only the output part, and the
draft takes the embedding it shares from the set's first part, so it drafts what the whole file's
draft drafts. With the first part absent, a clear error."""

from __future__ import annotations

import shutil

import pytest
import torch

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import ModelFileError
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.loader import write_split
from dwarfstar.speculative.mtp import load_draft
from dwarfstar.speculative.mtp_options import BUNDLED_MTP

NANO = default_model_path()
MTP = NANO.with_name(BUNDLED_MTP)
TOKENS = [0, 17, 42, 99, 5, 1000, 7, 12]


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    return write_split(NANO, [3], tmp_path_factory.mktemp("nano-halves") / "nano")


def drafted(engine, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    draft = load_draft(engine.backend, engine.model, MTP)
    return draft.rows(hidden, TOKENS[1:], draft.new_state())


def test_the_last_stage_of_a_split_set_drafts_as_the_whole_file(halves):
    whole = load_engine(EngineSpec(NANO, "reference", qat=False, ctx=64))
    _, hidden = whole.backend.forward_streams(TOKENS, whole.backend.new_state())
    stage = load_engine(EngineSpec(halves[1], "reference", qat=False, ctx=64, layers=(3, whole.model.args.n_layers)))
    assert stage.model.parts == (halves[1],)  # the stage itself maps only the output part
    want_logits, want_streams = drafted(whole, hidden[:-1])
    got_logits, got_streams = drafted(stage, hidden[:-1])
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_streams, want_streams)


def test_a_last_stage_without_the_first_part_is_refused(halves, tmp_path):
    alone = tmp_path / halves[1].name
    shutil.copy(halves[1], alone)
    stage = load_engine(EngineSpec(alone, "reference", qat=False, ctx=64, layers=(3, 6)))
    with pytest.raises(ModelFileError, match="token_embd"):
        load_draft(stage.backend, stage.model, MTP)
