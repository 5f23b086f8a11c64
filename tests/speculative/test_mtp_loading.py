"""Loading the MTP block from both layouts, and the clear errors around it."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPT, SMALL

from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.model.loader import open_model
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import MAX_DRAFT, Speculator
from dwarfstar.speculative.mtp import load_draft, open_mtp


def test_in_file_block_is_not_a_trunk_layer(mtp_files, engines):
    """block_count counts llama.cpp's MTP block; the trunk must still be the 4 layers, computing
    exactly what the same file without the block computes."""
    model = open_model(mtp_files["nextn"])
    assert (model.args.n_layers, model.args.n_mtp_layers) == (SMALL.n_layers, 1)
    with_block, without = engines("reference", "nextn").backend, engines("reference", "plain").backend
    got = with_block.forward(PROMPT, with_block.new_state())
    want = without.forward(PROMPT, without.new_state())
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", ["nextn", "ds4"])
def test_draft_is_one_window_only_layer(mtp_files, engines, layout):
    engine = engines("reference", "nextn")
    draft = load_draft(engine.backend, engine.model, mtp_files["ds4"] if layout == "ds4" else None)
    assert draft.mtp.layout == layout
    args = draft.model.args
    assert (args.n_layers, args.compress_ratios, args.n_hash_layers) == (1, (0,), 0)
    # the draft shares the trunk's embedding and output matrix
    assert torch.equal(draft.model.ops.embedding, engine.backend.ops.embedding)
    assert torch.equal(draft.model.ops.output, engine.backend.ops.output)


def test_layouts_read_the_same_projection_split(mtp_files, engines):
    """llama.cpp's eh_proj [D, 2D] is ds4's e_proj and h_proj side by side: a file converted from one
    to the other must give the same MTP input."""
    engine = engines("reference", "nextn")
    nextn = load_draft(engine.backend, engine.model).mix
    eh = open_model(mtp_files["nextn"]).gguf.tensor(f"blk.{SMALL.n_layers}.nextn.eh_proj.weight")
    assert torch.equal(torch.cat((nextn.e_proj, nextn.h_proj), dim=1), eh)


def test_model_without_mtp_names_the_flag(mtp_files):
    with pytest.raises(ModelFileError, match="no MTP block.*--mtp FILE"):
        open_mtp(open_model(mtp_files["plain"]))


def test_mtp_file_of_another_model(mtp_files):
    with pytest.raises(ModelFileError, match="MTP block of another model: embedding_length 128"):
        open_mtp(open_model(mtp_files["plain"]), mtp_files["other"])


def test_model_file_given_as_mtp_file(mtp_files):
    with pytest.raises(ModelFileError, match="is not an MTP file"):
        open_mtp(open_model(mtp_files["plain"]), mtp_files["plain"])


def test_missing_mtp_file(mtp_files, tmp_path):
    with pytest.raises(ModelFileError, match="MTP file not found"):
        open_mtp(open_model(mtp_files["plain"]), tmp_path / "absent.gguf")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_draft": 0}, f"--mtp-draft must be in 1..{MAX_DRAFT}, got 0"),
        ({"n_draft": MAX_DRAFT + 1}, f"--mtp-draft must be in 1..{MAX_DRAFT}, got {MAX_DRAFT + 1}"),
        ({"n_draft": 2, "margin": -1.0}, "--mtp-margin must be in 0..1000"),
        ({"n_draft": 2, "alignment": "previous"}, "unknown MTP alignment 'previous'"),
    ],
)
def test_bad_speculation_options(engines, options, message):
    engine = engines("reference", "nextn")
    draft = load_draft(engine.backend, engine.model)
    with pytest.raises(DwarfStarError, match=message):
        Speculator(Session(engine.backend, ctx=1024), draft, **options)
