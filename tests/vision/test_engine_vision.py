"""Loading a vision encoder beside a language model (`EngineSpec.vision`, `--vision`): the encoder made
for the model loads and encodes images and gives the backend its image router biases; one made for
another model or a V4.1 encoder beside a V4 model is a clear error before any image is read."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dwarfstar.engine.load import LM_VARIANT_KEY, load_engine, open_encoder
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, VISION_PRESETS, write_synthetic_model, write_synthetic_vision
from dwarfstar.model.vision import V41, VISION_TINY
from dwarfstar.model.vision_file import RouterShape

ROUTER = VISION_PRESETS["vision-tiny"][1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    model, encoder = root / "tiny.gguf", root / "encoder.gguf"
    write_synthetic_model(model, TINY, seed=0)
    write_synthetic_vision(encoder, VISION_TINY, seed=1, router=ROUTER)
    return root, model, encoder


def test_the_encoder_made_for_the_model_loads(files):
    _, model, encoder = files
    engine = load_engine(EngineSpec(model, "reference", ctx=512, vision=encoder))
    assert engine.images is not None and engine.images.args.out_dim == TINY.dim
    assert load_engine(EngineSpec(model, "reference", ctx=512)).images is None


@pytest.mark.parametrize(
    ("args", "router", "says"),
    [
        (replace(VISION_TINY, out_dim=2 * TINY.dim), ROUTER, "hidden size is 64"),
        (VISION_TINY, RouterShape(TINY.n_layers + 1, TINY.n_routed_experts, TINY.n_hash_layers, 1), "7 layers"),
        (VISION_TINY, RouterShape(TINY.n_layers, 2 * TINY.n_routed_experts, TINY.n_hash_layers, 1), "16 experts"),
        (replace(VISION_TINY, family=V41, image_token_id=129264), ROUTER, "only Vision-Exp encoders"),
    ],
    ids=["width", "layers", "experts", "v4.1"],
)
def test_an_encoder_made_for_another_model_is_refused(files, args, router, says):
    root, model, _ = files
    other = root / f"other-{says.split()[0]}.gguf"
    write_synthetic_vision(other, args, seed=1, router=router)
    with pytest.raises(DwarfStarError, match=says):
        load_engine(EngineSpec(model, "reference", ctx=512, vision=other))


def test_every_backend_takes_the_image_biases(files):
    """The MLX backend too gets the encoder file's router biases: it runs image blocks
    (tests/backends/test_conformance_images.py), refused before them (`Ops.check_images`)."""
    pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu])")
    _, model, encoder = files
    without = load_engine(EngineSpec(model, "mlx", ctx=512)).backend
    with pytest.raises(DwarfStarError, match="image router biases"):
        without.ops.check_images()
    load_engine(EngineSpec(model, "mlx", ctx=512, vision=encoder)).backend.ops.check_images()


def test_a_language_model_of_another_variant_is_refused(files):
    _, model_path, encoder = files
    model = open_model(model_path)
    assert open_encoder(encoder, model).args == VISION_TINY  # no variant named: the checks above decide
    model.gguf.metadata[LM_VARIANT_KEY] = "0731"  # as ds4's files name their checkpoint
    with pytest.raises(DwarfStarError, match="'0731' checkpoint, which reads no images"):
        open_encoder(encoder, model)
    model.gguf.metadata[LM_VARIANT_KEY] = "vision-exp"
    assert open_encoder(encoder, model).args == VISION_TINY
