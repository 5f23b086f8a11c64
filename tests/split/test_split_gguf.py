"""Split GGUF sets (ds4's `…-Layers00-30.gguf` + `…-Layers-31-output.gguf`): a model written as parts
computes what the single file does, a stage maps only the parts holding its layers, and a missing,
foreign or misnamed part is named in the error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.loader import open_model, write_split
from dwarfstar.model.synthetic import TINY, write_synthetic_model

TOKENS = [0, 17, 42, 99, 1000, 5, 7, 128000, 3, 64, 65, 66]  # past the tiny raw window of 8


@pytest.fixture(scope="module")
def single(tiny_model_file) -> Path:
    return tiny_model_file(0)


@pytest.fixture(scope="module")
def halves(single, tmp_path_factory) -> list[Path]:
    return write_split(single, [3], tmp_path_factory.mktemp("halves") / "tiny")


@pytest.fixture(scope="module")
def thirds(single, tmp_path_factory) -> list[Path]:
    return write_split(single, [2, 4], tmp_path_factory.mktemp("thirds") / "tiny")


def logits_of(model_path: Path) -> torch.Tensor:
    model = open_model(model_path)
    try:
        ref = ReferenceModel(model, qat=False)
        return ref.forward(TOKENS, ref.new_state())
    finally:
        model.close()


def test_parts_are_named_as_ds4_names_them(halves, thirds) -> None:
    assert [p.name for p in halves] == ["tiny-Layers00-02.gguf", "tiny-Layers-03-output.gguf"]
    assert [p.name for p in thirds] == ["tiny-Layers00-01.gguf", "tiny-Layers-02-03.gguf", "tiny-Layers-04-output.gguf"]
    with GGUFFile(halves[0]) as first, GGUFFile(halves[1]) as last:
        assert "token_embd.weight" in first.tensors and "output.weight" not in first.tensors
        assert "output.weight" in last.tensors and "token_embd.weight" not in last.tensors
        assert first.metadata == last.metadata  # every part carries the model's metadata


def test_a_split_set_gives_the_logits_of_the_single_file(single, halves, thirds) -> None:
    expected = logits_of(single)
    for part in (halves[1], thirds[0]):  # opened from any of its parts, the set is found
        assert torch.equal(logits_of(part), expected)
    model = open_model(halves[1])
    assert model.parts == tuple(halves) and model.layers is None and model.has_embedding and model.has_head
    model.close()


def test_a_link_to_a_part_opens_the_set(halves, tmp_path) -> None:
    """`./ds4flash.gguf` or `-m` pointing at a part: the set is looked for next to the part."""
    link = tmp_path / "ds4flash.gguf"
    link.symlink_to(halves[0])
    model = open_model(link)
    assert model.path == link and model.parts == tuple(halves)
    model.close()


def test_a_stage_maps_only_the_parts_holding_its_layers(thirds) -> None:
    first, middle, last = thirds
    stage = open_model(first, layers=(2, 4))
    assert stage.parts == (middle,) and stage.layer_range == range(2, 4)
    assert not stage.has_embedding and not stage.has_head
    assert {name.split(".")[1] for name in stage.gguf.tensors} == {"2", "3"}
    stage.close()
    head = open_model(middle, layers=(4, 6))
    assert head.parts == (last,) and head.has_head and "output.weight" in head.gguf.tensors
    head.close()
    spanning = open_model(last, layers=(0, 3))
    assert spanning.parts == (first, middle) and spanning.has_embedding and not spanning.has_head
    spanning.close()


def test_a_worker_with_only_its_part_on_disk(halves, tmp_path) -> None:
    alone = tmp_path / halves[1].name
    shutil.copy(halves[1], alone)
    stage = open_model(alone, layers=(3, 6))
    assert stage.parts == (alone,)
    stage.close()
    with pytest.raises(ModelFileError, match=r"for layers 0-2: .*\(a part such as tiny-Layers00-02\.gguf\)"):
        open_model(alone)
    with pytest.raises(ModelFileError, match=r"for layers 1-2: no tiny-Layers\*\.gguf in .* holds them"):
        open_model(alone, layers=(1, 6))  # layers 1-2 are in no file here


def test_a_missing_head_or_middle_part_is_named(thirds, tmp_path) -> None:
    for kept in (thirds[0], thirds[1]):
        shutil.copy(kept, tmp_path / kept.name)
    with pytest.raises(ModelFileError, match=r"for layers 4-output: .*such as tiny-Layers-04-output\.gguf"):
        open_model(tmp_path / thirds[0].name)
    (tmp_path / thirds[1].name).unlink()
    shutil.copy(thirds[2], tmp_path / thirds[2].name)
    with pytest.raises(ModelFileError, match=r"for layers 2-3: .*such as tiny-Layers-02-03\.gguf"):
        open_model(tmp_path / thirds[2].name)


def test_a_part_of_another_model_is_refused(halves, tmp_path) -> None:
    """The architecture keys must agree; here the second part claims twice the experts."""
    shutil.copy(halves[0], tmp_path / halves[0].name)
    with GGUFFile(halves[1]) as src:
        meta = src.typed_metadata()
        meta["deepseek4.expert_count"] = (ValueType.UINT32, 16)
        with GGUFWriter(tmp_path / halves[1].name, meta) as writer:
            for info in src.tensors.values():
                writer.add_tensor(info.name, info.shape, info.ggml_type)
            for info in src.tensors.values():
                writer.write_tensor(info.name, src.raw(info.name))
    foreign = r"tiny-Layers-03-output\.gguf is not a part of the same model .*expert_count is 16 there and 8 here"
    with pytest.raises(ModelFileError, match=foreign):
        open_model(tmp_path / halves[0].name)


def test_a_misnamed_or_overlapping_part_is_refused(halves, thirds, tmp_path) -> None:
    shutil.copy(halves[0], tmp_path / "tiny-Layers00-01.gguf")  # holds layers 0-2
    shutil.copy(thirds[1], tmp_path / "tiny-Layers-02-03.gguf")
    shutil.copy(thirds[2], tmp_path / "tiny-Layers-04-output.gguf")
    with pytest.raises(ModelFileError, match=r"tiny-Layers00-01\.gguf holds layers 0-2, but its name says layers 0-1"):
        open_model(tmp_path / "tiny-Layers-04-output.gguf")
    shutil.copy(halves[1], tmp_path / "tiny-Layers-03-output.gguf")
    with pytest.raises(ModelFileError, match=r"both claim layer 3"):
        open_model(tmp_path / "tiny-Layers-04-output.gguf")


def test_bad_layer_ranges_and_split_points(single, halves, tmp_path) -> None:
    for bad in ((3, 3), (-1, 2), (0, 7)):
        with pytest.raises(ModelFileError, match=r"not a slice of its 6 layers"):
            open_model(halves[0], layers=bad)
    with pytest.raises(ModelFileError, match=r"not a slice of its 6 layers"):
        open_model(single, layers=(4, 2))
    with pytest.raises(ModelFileError, match=r"split points \[6\] must be layers between 1 and 5"):
        write_split(single, [6], tmp_path / "bad")


def test_a_single_file_opens_for_a_layer_range_too(single) -> None:
    stage = open_model(single, layers=(2, 6))
    assert stage.parts == (single,) and stage.has_head and not stage.has_embedding
    stage.close()


def test_a_llama_cpp_gguf_split_file_is_refused_clearly(single, tmp_path) -> None:
    with GGUFFile(single) as src:
        meta = src.typed_metadata()
    meta["split.no"] = (ValueType.UINT16, 0)
    meta["split.count"] = (ValueType.UINT16, 3)
    path = tmp_path / "model-00001-of-00003.gguf"
    with GGUFWriter(path, meta):
        pass
    with pytest.raises(ModelFileError, match=r"file 1 of 3 of a llama.cpp gguf-split set.*llama-gguf-split --merge"):
        open_model(path)


def test_an_in_file_mtp_block_goes_with_the_output_part(tmp_path) -> None:
    """llama.cpp's layout counts the MTP block (blk.6.nextn.*) in block_count: it is no trunk layer."""
    whole = tmp_path / "mtp.gguf"
    write_synthetic_model(whole, TINY, in_file_mtp=True)
    first, last = write_split(whole, [3], tmp_path / "mtp")
    with GGUFFile(last) as part:
        assert "blk.6.nextn.eh_proj.weight" in part.tensors
    model = open_model(first)
    assert model.args.n_layers == 6 and "blk.6.nextn.eh_proj.weight" in model.gguf.tensors
    model.close()
    stage = open_model(first, layers=(3, 6))
    assert stage.parts == (last,) and stage.has_head
    stage.close()
    with pytest.raises(ModelFileError, match=r"layers \(3, 7\) are not a slice of its 6 layers"):
        open_model(first, layers=(3, 7))
