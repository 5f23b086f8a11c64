"""DeepSeek V4.1 split sets in ds4's naming (`…-Layers00-01.gguf`, `…-Layers-02-05.gguf`,
`…-Layers-06-output.gguf`; issue 33): `v41-tiny` written as parts computes the single file's logits
exactly, each Engram table is read from the part holding its layer, a stage maps only the parts holding
its layers (and the stages chained compute the single file's logits), and a missing, foreign, overlapping,
misnamed or truncated part, or a part storing a tensor after its Engram table, is a clear error naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli_front import cli

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.cli import _register_commands
from dwarfstar.distributed.dist_options import DistOptions
from dwarfstar.distributed.membership import model_identity
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.engram.store import EngramStore
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf import split
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model import file_v41
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.loader import is_v41, open_model, write_split
from dwarfstar.model.tensors_v41 import engram_table

_register_commands()

PROMPT = [(7919 * i + 101) % 120000 for i in range(24)]  # past the window of 8; every token reads Engram rows
DECODE = [311, 4027, 99]
N_LAYERS = 12  # v41-tiny: Engram on layers 1 and 6; a stage may start at 1, 2, 4 or 6


@pytest.fixture(scope="module")
def thirds(v41_tiny_file, tmp_path_factory) -> list[Path]:
    """Layers 0-1 (the embedding, Engram layer 1), 2-5 (no Engram layer), 6-11 (Engram layer 6, the head)."""
    return write_split(v41_tiny_file, [2, 6], tmp_path_factory.mktemp("v41-thirds") / "v41")


@pytest.fixture(scope="module")
def halves(thirds, tmp_path_factory) -> list[Path]:
    """The set split again at layer 6 only: layers 0-5 come from two parts, layer 1's table before layers 2-5."""
    return write_split(thirds[1], [6], tmp_path_factory.mktemp("v41-halves") / "v41")


@pytest.fixture(scope="module")
def v4_halves(tiny_model_file, tmp_path_factory) -> list[Path]:
    return write_split(tiny_model_file(0), [3], tmp_path_factory.mktemp("v4-halves") / "v41")


def run(model: file_v41.ModelFile41) -> tuple[list[torch.Tensor], int]:
    """The reference's logits after PROMPT, then after each DECODE token; and the Engram rows it read."""
    backend = ReferenceModel41.from_file(model, 0, 256)
    state = backend.new_state()
    out = [backend.forward(PROMPT, state, all_logits=False)[0]]
    out += [backend.forward([t], state, all_logits=False)[0] for t in DECODE]
    return out, backend.transformer.ops.store.telemetry()["misses"]


def copy(paths: list[Path], where: Path) -> list[Path]:
    where.mkdir(exist_ok=True)
    return [Path(shutil.copy(path, where / path.name)) for path in paths]


def test_parts_hold_their_layers_and_engram_tables_last(v41_tiny_file, thirds, halves) -> None:
    assert [p.name for p in thirds] == ["v41-Layers00-01.gguf", "v41-Layers-02-05.gguf", "v41-Layers-06-output.gguf"]
    assert [p.name for p in halves] == ["v41-Layers00-05.gguf", "v41-Layers-06-output.gguf"]
    assert all(is_v41(part) for part in thirds)
    tables = [engram_table(1), None, engram_table(6), engram_table(1), engram_table(6)]
    written = zip([*thirds, *halves], tables, strict=True)
    with GGUFFile(v41_tiny_file) as whole:
        for part, table in written:
            with GGUFFile(part) as gguf:
                assert gguf.metadata == whole.metadata  # every part carries the model's metadata
                tables = [name for name in gguf.tensors if name.endswith("engram_embd.weight")]
                assert tables == ([] if table is None else [table])
                if table is not None:  # after every other tensor of its part, its bytes the single file's
                    last = max(gguf.tensors.values(), key=lambda info: info.offset)
                    assert last.name == table and bytes(gguf.raw(table)) == bytes(whole.raw(table))


def test_a_set_gives_the_single_files_logits(v41_tiny_file, thirds) -> None:
    single = open_model41(v41_tiny_file)
    want, read = run(single)
    single.close()
    assert read > 0  # the Engram layers read rows
    for named in (thirds[2], thirds[1]):  # opened from any of its parts, the set is found
        model = open_model41(named)
        assert model.parts == tuple(thirds) and model.layers is None and model.path == named
        got, got_read = run(model)
        model.close()
        assert got_read == read and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_each_engram_table_is_read_from_its_part(v41_tiny_file, thirds) -> None:
    single, model = open_model41(v41_tiny_file), open_model41(thirds[0])
    assert {il: e.path for il, e in model.engram.items()} == {1: thirds[0], 6: thirds[2]}
    with GGUFFile(thirds[0]) as first, GGUFFile(thirds[2]) as last:
        offsets = {1: first.tensors[engram_table(1)].offset, 6: last.tensors[engram_table(6)].offset}
    assert {il: e.offset for il, e in model.engram.items()} == offsets  # the part's own offsets
    assert offsets != {il: e.offset for il, e in single.engram.items()}  # which are not the single file's
    assert {il: e.rows for il, e in model.engram.items()} == {il: e.rows for il, e in single.engram.items()}
    ours, theirs = EngramStore(model.engram, 0), EngramStore(single.engram, 0)
    try:
        assert set(ours._fds) == {thirds[0], thirds[2]}
        for il, extent in single.engram.items():
            ids = np.unique(np.random.default_rng(il).integers(0, extent.rows, 200))
            ids = np.concatenate(([0], ids, [extent.rows - 1]))
            rows = ours.raw(il, ids)
            assert rows.any() and np.array_equal(rows, theirs.raw(il, ids))
    finally:
        ours.close()
        theirs.close()
        model.close()
        single.close()


def test_a_slice_maps_only_the_parts_holding_its_layers(v41_tiny_file, thirds, monkeypatch) -> None:
    first, middle, last = thirds
    events: list[tuple[str, str]] = []

    class Recorded(GGUFFile):
        def __init__(self, path) -> None:
            super().__init__(path)
            events.append(("open", Path(path).name))

        def close(self) -> None:
            events.append(("close", self.path.name))
            super().close()

    for module in (split, file_v41):
        monkeypatch.setattr(module, "GGUFFile", Recorded)

    def opened(named: Path, layers: tuple[int, int]) -> tuple[file_v41.ModelFile41, set[str], set[str]]:
        events.clear()
        model = open_model41(named, layers)
        names = {name for what, name in events if what == "open"}
        return model, names, names - {name for what, name in events if what == "close"}

    model, seen, mapped = opened(first, (6, N_LAYERS))  # the part named gives the config, then is unmapped
    assert seen == {first.name, last.name} and mapped == {last.name} and model.parts == (last,)
    assert model.layer_range == range(6, N_LAYERS) and list(model.engram) == [6] and model.engram[6].path == last
    assert model.holds("output.weight") and not model.holds("token_embd.weight") and not model.holds("blk.5.sinks")
    assert not model.holds(engram_table(6))
    backend = ReferenceModel41.from_file(model, 0, 256)  # its backend reads only its own tensors and table
    assert set(backend.transformer.ops.store._fds) == {last} and backend.transformer.ops.embedding is None
    model.close()
    model, seen, mapped = opened(last, (2, 6))
    assert seen == {last.name, middle.name} and mapped == {middle.name}
    assert model.parts == (middle,) and model.engram == {}
    assert {name.split(".")[1] for name in model.gguf.tensors} == {"2", "3", "4", "5"}
    model.close()
    model, _, mapped = opened(middle, (0, 6))
    assert mapped == {first.name, middle.name} and model.parts == (first, middle) and list(model.engram) == [1]
    model.close()
    with GGUFFile(middle) as part:  # a slice of the single file holds what the part holding it has
        held = sum(info.nbytes for info in part.tensors.values())
    model = open_model41(v41_tiny_file, (2, 6))
    assert model.parts == (v41_tiny_file,) and model.engram == {} and model.resident_bytes == held
    model.close()


def test_stages_of_a_set_compute_the_single_files_logits(v41_tiny_file, thirds, tmp_path) -> None:
    """Three stages, each loaded from its own part alone (as on three machines), chained as a route chains
    them: the single file's logits, bit for bit."""
    cuts = [(0, 2), (2, 6), (6, N_LAYERS)]
    alone = [copy([part], tmp_path / f"stage{i}")[0] for i, part in enumerate(thirds)]
    engines = []
    for part, layers in zip(alone, cuts, strict=True):
        worker = DistOptions.resolved(role="worker", layers=f"{layers[0]}:{layers[1]}", addr="127.0.0.1:1")
        assert worker.stage_layers(part) == layers  # from its part's header alone
        engine = load_engine(EngineSpec(part, "reference", ctx=256, engram_cache=1, layers=layers))
        assert engine.model.parts == (part,) and engine.backend.layer_range == range(*layers)
        engines.append(engine)
    assert len({model_identity(engine.model) for engine in engines}) == 1  # they may join one route
    stages = [engine.backend.transformer for engine in engines]
    states = [engine.backend.new_state() for engine in engines]
    got = []
    for tokens in [PROMPT, *([t] for t in DECODE)]:
        streams = stages[0].enter(tokens)
        for stage, state in zip(stages, states, strict=True):
            streams = stage.run(stage.begin(tokens, state), state, streams)
        got.append(stages[-1].logits(streams))
    single = open_model41(v41_tiny_file)
    want, _ = run(single)
    single.close()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for engine in engines:
        engine.model.close()


@pytest.mark.parametrize("backend", ["mlx", "triton"])
def test_the_other_backends_load_a_stage_from_its_part_alone(thirds, tmp_path, backend) -> None:
    """What a stage of MLX or Triton reads is its slice's: its layers, the head and not the embedding."""
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu] on Linux)")
    last = copy([thirds[2]], tmp_path)[0]
    engine = load_engine(EngineSpec(last, backend, ctx=256, engram_cache=1, layers=(6, N_LAYERS)))
    ops = engine.backend.transformer.ops
    assert engine.backend.layer_range == range(6, N_LAYERS) and set(ops.store.extents) == {6}
    if backend == "mlx":
        assert ops.embedding is None and ops.output is not None and set(ops.layers) == set(range(6, N_LAYERS))
    else:
        names = {*ops.w.matrices, *ops.w.vectors}
        assert "token_embd.weight" not in names and {"output.weight", "output_norm.weight"} <= names
        assert {int(name.split(".")[1]) for name in names if name.startswith("blk.")} == set(range(6, N_LAYERS))
    engine.model.close()


def test_a_missing_part_is_named(thirds, tmp_path) -> None:
    first, last = copy([thirds[0], thirds[2]], tmp_path)
    for named in (first, last):
        with pytest.raises(ModelFileError, match=r"missing part for layers 2-5: .*such as v41-Layers-02-05\.gguf"):
            open_model41(named)
    stage = open_model41(last, (6, N_LAYERS))  # a stage whose parts are there opens
    stage.close()
    with pytest.raises(ModelFileError, match=r"missing part for layers 2-5"):
        load_engine(EngineSpec(first, "reference", ctx=256, engram_cache=1))


def test_a_v4_part_in_a_v41_set_and_the_reverse_are_refused(thirds, v4_halves, tmp_path) -> None:
    v41 = copy(thirds[:2], tmp_path / "v41")
    mixed = Path(shutil.copy(v4_halves[1], tmp_path / "v41" / thirds[2].name))  # a V4 part named as V4.1's head
    foreign = rf"{mixed.name} is not a part of the same model .*general.architecture is 'deepseek4' there"
    with pytest.raises(ModelFileError, match=foreign):
        open_model41(v41[0])
    with pytest.raises(ModelFileError, match=rf"{mixed.name} is DeepSeek V4 \('deepseek4'\), not DeepSeek V4.1"):
        open_model41(mixed)
    v4 = copy(v4_halves[:1], tmp_path / "v4")[0]  # v41-Layers00-02.gguf, V4's layers 0-2
    intruder = Path(shutil.copy(thirds[2], tmp_path / "v4" / v4_halves[1].name))  # a V4.1 part as V4's head
    foreign = rf"{intruder.name} is not a part of the same model .*general.architecture is 'deepseek41' there"
    with pytest.raises(ModelFileError, match=foreign):
        open_model(v4)
    with pytest.raises(ModelFileError, match=rf"{v4.name} is not a part of the same model .*'deepseek4' there"):
        load_engine(EngineSpec(intruder, "reference", ctx=256, engram_cache=1))  # a V4.1 part: V4.1's loader


def test_overlapping_or_misnamed_parts_are_refused(thirds, halves, tmp_path) -> None:
    parts = copy(thirds, tmp_path / "set")
    shutil.copy(halves[0], tmp_path / "set" / halves[0].name)  # v41-Layers00-05 beside v41-Layers00-01
    with pytest.raises(ModelFileError, match=r"v41-Layers00-0[15]\.gguf .* and v41-Layers00-0[15]\.gguf .* both claim"):
        open_model41(parts[2])
    (tmp_path / "set" / halves[0].name).unlink()
    parts[0].unlink()
    misnamed = Path(shutil.copy(halves[0], tmp_path / "set" / "v41-Layers00-01.gguf"))  # holds layers 0-5
    with pytest.raises(ModelFileError, match=rf"{misnamed.name} holds layers 0-5, but its name says layers 0-1"):
        open_model41(parts[2])


def test_a_truncated_engram_table_in_a_part_is_named(thirds, tmp_path) -> None:
    parts = copy(thirds, tmp_path)
    data = parts[2].read_bytes()
    parts[2].write_bytes(data[: len(data) - 20000])  # into layer 6's table, the last of its part
    cut = rf"{parts[2].name}: tensor 'blk\.6\.engram_embd\.weight' data runs past the end .*truncated"
    with pytest.raises(ModelFileError, match=cut):
        open_model41(parts[0])
    stage = open_model41(parts[0], (0, 6))  # a stage without that part opens
    stage.close()
    parts[2].write_bytes(data)
    model = open_model41(parts[0])  # a part cut short after its header was read: the store names it
    parts[2].write_bytes(data[: len(data) - 20000])
    with pytest.raises(ModelFileError, match=rf"{parts[2].name}: layer 6's Engram table .* the file is truncated"):
        EngramStore(model.engram, 0)
    model.close()


def test_a_tensor_after_an_engram_table_in_a_part_is_named(thirds, tmp_path) -> None:
    parts = copy(thirds, tmp_path)
    with GGUFFile(thirds[0]) as src:  # layer 1's table first, then the rest of the part
        names = sorted(src.tensors, key=lambda name: name != engram_table(1))
        with GGUFWriter(parts[0], src.typed_metadata(), alignment=src.alignment) as writer:
            for name in names:
                writer.add_tensor(name, src.tensors[name].shape, src.tensors[name].ggml_type)
            for name in names:
                writer.write_tensor(name, src.raw(name))
    late = rf"{parts[0].name}: '.*' is stored after an Engram table; ds4 stores the tables last"
    with pytest.raises(ModelFileError, match=late):
        open_model41(parts[2])
    stage = open_model41(parts[2], (2, N_LAYERS))  # the other parts keep the rule
    stage.close()


def test_synth_writes_and_inspect_reads_a_v41_set(tmp_path, monkeypatch, capsys) -> None:
    code, out, err = cli(
        monkeypatch, capsys, "synth", str(tmp_path / "t.gguf"), "--preset", "v41-tiny", "--split-at", "6"
    )
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t-Layers-06-output.gguf", "t-Layers00-05.gguf"]
    code, out, err = cli(monkeypatch, capsys, "inspect", str(tmp_path / "t-Layers-06-output.gguf"))
    assert code == 0, err
    assert "split set of 2 parts" in out and "complete" in out
    assert "DeepSeek V4.1 Flash (deepseek41): 12 layers" in out and "2 parts" in out
    assert "Engram layer 1: 2,946 rows" in out and "Engram layer 6: 6,076 rows" in out
    code, _, err = cli(
        monkeypatch, capsys, "synth", str(tmp_path / "s.gguf"), "--preset", "v41-shaped", "--split-at", "2"
    )
    assert code == 2 and "holes" in err and not list(tmp_path.glob("s*"))
