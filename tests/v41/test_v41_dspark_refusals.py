"""What a V4.1 DSpark drafter refuses, by name (issue 33 item 6): another family's drafter either way, a
support file whose target layers or expert counts do not fit the model, and --mtp with a V4.1 model;
`--dspark-strict` checks the drafter when the engine loads."""

from __future__ import annotations

import re

import pytest

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.dspark_v41 import DSparkArgs41, dspark_tensors41, support_metadata41
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_draft, write_synthetic_dspark
from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY, write_synthetic_dspark41
from dwarfstar.speculative.dspark import DSparkDraft
from dwarfstar.speculative.dspark_v41 import DSparkDraft41
from dwarfstar.speculative.mtp_options import MTP41_REFUSAL, DSparkOptions, MTPOptions

D4 = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)


@pytest.fixture(scope="module")
def v41(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=64))


def test_a_v4_drafter_is_refused_by_a_v41_model_by_name(v41, tmp_path):
    v4_support = tmp_path / "v4-dspark.gguf"
    write_synthetic_dspark(v4_support, TINY, D4)
    with pytest.raises(
        ModelFileError, match=r"a DSpark drafter for DeepSeek V4 \(deepseek4-dspark\).*is DeepSeek V4\.1"
    ):
        DSparkDraft41(v41.backend, v41.model, v4_support)


def test_a_v41_drafter_is_refused_by_a_v4_model_by_name(tiny_model_file, v41_dspark_file):
    model = open_model(tiny_model_file(0))
    with pytest.raises(
        ModelFileError, match=r"a DSpark drafter for DeepSeek V4\.1 \(deepseek41-dspark\).*is DeepSeek V4:"
    ):
        DSparkDraft(ReferenceModel(model, qat=False), model, v41_dspark_file)


def test_a_drafter_for_layers_the_model_lacks_is_refused(v41, tmp_path):
    wrong = DSparkArgs41(DSparkArgs(target_layers=(10, 11, 12), markov_rank=16), n_experts=6, top_k=3)
    path = tmp_path / "layers.gguf"
    write_synthetic_dspark41(path, V41_TINY, wrong)
    with pytest.raises(ModelFileError, match=r"drafts for a model with layers \[10, 11, 12\]; the target has 12"):
        DSparkDraft41(v41.backend, v41.model, path)


def test_a_drafter_whose_expert_counts_do_not_fit_is_refused(v41, tmp_path):
    stated = DSparkArgs41(TINY_DSPARK41.d, n_experts=4, top_k=3)  # the metadata says 4, the tensors hold 6
    path = tmp_path / "experts.gguf"
    write_draft(path, V41_TINY, support_metadata41(stated, "bad"), dspark_tensors41(V41_TINY, TINY_DSPARK41), "f32", 0)
    with pytest.raises(ModelFileError, match=r"the DSpark drafter does not fit .*ffn_gate_inp"):
        DSparkDraft41(v41.backend, v41.model, path)
    top = tmp_path / "top.gguf"
    stated = DSparkArgs41(TINY_DSPARK41.d, n_experts=6, top_k=7)
    write_draft(top, V41_TINY, support_metadata41(stated, "bad"), dspark_tensors41(V41_TINY, TINY_DSPARK41), "f32", 0)
    with pytest.raises(ModelFileError, match=r"route to 7 of 6 experts"):
        DSparkDraft41(v41.backend, v41.model, top)


def test_a_v41_support_file_without_the_expert_counts_is_refused(v41, tmp_path):
    metadata = support_metadata41(TINY_DSPARK41, "bad")
    del metadata["dspark.expert_count"]
    path = tmp_path / "no-experts.gguf"
    write_draft(path, V41_TINY, metadata, dspark_tensors41(V41_TINY, TINY_DSPARK41), "f32", 0)
    with pytest.raises(ModelFileError, match=r"no dspark\.expert_count"):
        DSparkDraft41(v41.backend, v41.model, path)


def test_mtp_is_refused_for_v41_and_strict_dspark_checks_the_drafter(v41_tiny_file, v41_dspark_file, tmp_path):
    with pytest.raises(DwarfStarError, match=re.escape(MTP41_REFUSAL)):
        load_engine(EngineSpec(v41_tiny_file, "reference", ctx=64, speculation=MTPOptions(None, 2)))
    engine = load_engine(
        EngineSpec(v41_tiny_file, "reference", ctx=64, speculation=DSparkOptions(v41_dspark_file, strict=True))
    )
    assert engine.backend.args.n_layers == V41_TINY.n_layers  # loaded, its drafter checked
    with pytest.raises(ModelFileError, match="DSpark support file not found"):
        load_engine(
            EngineSpec(v41_tiny_file, "reference", ctx=64, speculation=DSparkOptions(tmp_path / "none", strict=True))
        )
