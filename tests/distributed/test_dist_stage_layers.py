"""A stage's model holds only its layer range: the weights it reads from the file, the ones it keeps,
and the KV arrays of its states; chained, the stages compute the one-process logits bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.distributed.membership import LayerSlice
from dwarfstar.distributed.protocol import DistError
from dwarfstar.engine.launch import DistOptions, local_model
from dwarfstar.engine.load import Engine
from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.split import layer_of
from dwarfstar.model.loader import ModelFile, open_model
from dwarfstar.model.tensors import EMBED

PROMPT = [0, 17, 42, 7, 99, 1000, 5, 31, 64, 2, 11]
CTX = 64
SPLIT = 3  # tiny has 6 layers: stages [0, 3) and [3, 6)


class ReadLog:
    """A model file's tensor reader that records the name of every tensor read through it."""

    def __init__(self, gguf) -> None:
        self.gguf, self.names = gguf, set()

    def raw(self, name: str):
        self.names.add(name)
        return self.gguf.raw(name)

    def tensor(self, name: str):
        self.names.add(name)
        return self.gguf.tensor(name)

    def __getattr__(self, name: str):
        return getattr(self.gguf, name)


def logged(path, layers: tuple[int, int] | None) -> ModelFile:
    model = open_model(path, layers)
    return dataclasses.replace(model, gguf=ReadLog(model.gguf))


def stage_tensors(model: ModelFile, layers: range) -> set[str]:
    """The file's tensors a stage of `layers` needs: its blocks', the embedding on the first, the head on the last."""
    n = model.args.n_layers
    out = set()
    for name in model.gguf.tensors:
        il = layer_of(name)
        if il is None:
            wanted = layers.start == 0 if name == EMBED else layers.stop == n
        else:
            wanted = il in layers
        if wanted:
            out.add(name)
    return out


def resident_tensors(ops) -> list[torch.Tensor]:
    """Every distinct torch tensor the reference ops keep (per-layer weights, embedding, head)."""
    found: dict[int, torch.Tensor] = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found[id(value)] = value
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        elif dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                walk(getattr(value, field.name))

    walk([ops.embedding, ops.head_hc, ops.out_norm, ops.output, ops.layers])
    return list(found.values())


def chain(stages, tokens: list[int]) -> tuple[torch.Tensor, list]:
    """The tokens through the stages in order, as a route runs them: each its own state and slice."""
    states, h = [stage.new_state() for stage in stages], None
    with torch.inference_mode():
        for stage, state in zip(stages, states, strict=True):
            batch = stage.batch([tokens], [state])
            embedded = stage.embed(batch)
            held = stage.layer_range
            h = stage.run_layers(embedded if h is None else h, batch, held.start, held.stop)
            if stage.holds_head:
                y, _ = stage.head(h, batch, True)
                logits = stage.ops.logits(y, batch)
            stage.advance(batch)
    return logits, states


@pytest.fixture(scope="module")
def tiny_path(tiny_model_file):
    return tiny_model_file(0)


def test_reference_stages_read_and_keep_only_their_layers(tiny_path):
    full_file = logged(tiny_path, None)
    full = ReferenceModel(full_file, max_seq_len=CTX)
    n = full.args.n_layers
    want = full.forward(PROMPT, full.new_state(), all_logits=True)
    files = [logged(tiny_path, (0, SPLIT)), logged(tiny_path, (SPLIT, n))]
    stages = [ReferenceModel(f, max_seq_len=CTX) for f in files]
    got, states = chain(stages, PROMPT)
    assert torch.equal(got, want)

    first, last = stages
    assert sorted(first.ops.layers) == [0, 1, 2] and sorted(last.ops.layers) == [3, 4, 5]
    assert first.ops.embedding is not None and first.ops.output is None and first.ops.head_hc is None
    assert last.ops.embedding is None and last.ops.output is not None
    # every tensor read (the routed experts too, read as the router picks them) is the stage's own
    for f, stage in zip(files, stages, strict=True):
        assert f.gguf.names == stage_tensors(f, stage.layer_range)
        assert {name for name in f.gguf.tensors if f.holds(name)} == f.gguf.names  # what the memory check counts
    assert files[0].gguf.names | files[1].gguf.names == full_file.gguf.names
    assert not files[0].gguf.names & files[1].gguf.names

    # what they keep: the one-process tensors, split between them (a dense tensor once, 4 bytes each)
    kept = [resident_tensors(s.ops) for s in (full, first, last)]
    counts = [len(k) for k in kept]
    nbytes = [sum(t.numel() * t.element_size() for t in k) for k in kept]
    assert counts[1] + counts[2] == counts[0] and 0 < counts[1] < counts[0]
    assert nbytes[1] + nbytes[2] == nbytes[0] and 0 < nbytes[2] < nbytes[0]


def test_a_stage_state_holds_only_its_layers_kv(tiny_path):
    full = ReferenceModel(open_model(tiny_path), max_seq_len=CTX)
    n = full.args.n_layers
    stages = [ReferenceModel(open_model(tiny_path, (0, SPLIT)), max_seq_len=CTX)]
    stages.append(ReferenceModel(open_model(tiny_path, (SPLIT, n)), max_seq_len=CTX))
    whole = full.new_state()
    full.forward(PROMPT, whole)
    _, states = chain(stages, PROMPT)
    for stage, state in zip(stages, states, strict=True):
        assert list(state.cache.blocks[0]) == list(stage.layer_range)
        for il in stage.layer_range:  # its layers' parts, equal to the one-process state's
            got, want = state.host_parts(il), whole.host_parts(il)
            assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
        other = 0 if stage.layer_range.start else n - 1
        with pytest.raises(DwarfStarError, match=f"layer {other} has no KV arrays here"):
            state.part(other, "raw")
    whole.logits = None  # nbytes counts the logits; a stage state has none
    assert states[0].nbytes() + states[1].nbytes() == whole.nbytes()
    # the arrays allocated: a layer's parts on exactly one stage, the same shapes as on one process
    for stage in stages:
        for il, parts in stage.cache.blocks[0].items():
            assert {k: v.shape for k, v in parts.items()} == {k: v.shape for k, v in full.cache.blocks[0][il].items()}


def test_a_stage_refuses_layers_and_head_it_does_not_hold(tiny_path):
    n = 6
    middle = ReferenceModel(open_model(tiny_path, (2, 4)), max_seq_len=CTX)
    state = middle.new_state()
    batch = middle.batch([PROMPT], [state])
    assert middle.embed(batch) is None  # only the call's preparation: no embedding here
    h = torch.zeros(len(PROMPT), middle.args.hc_mult, middle.args.dim)
    with pytest.raises(DwarfStarError, match="layers 1..3 are not all loaded here: this model holds layers 2..3"):
        middle.run_layers(h, batch, 1, 4)
    with pytest.raises(DwarfStarError, match="output head is not loaded"):
        middle.head(h, batch, True)
    with pytest.raises(DwarfStarError, match="layers 0..5 are not all loaded"):
        middle.forward(PROMPT, middle.new_state())
    engine = Engine(open_model(tiny_path, (2, 4)), middle, "reference", None, 0.0)
    with pytest.raises(DistError, match="loaded layers 2..3, which do not cover its slice 3:output"):
        local_model(engine, LayerSlice(3, n, n))


def test_stage_layers_before_loading(tiny_path):
    assert DistOptions.resolved().stage_layers(tiny_path) is None  # one process: every layer
    worker = DistOptions.resolved(role="worker", layers="3:output", addr="127.0.0.1:1")
    assert worker.stage_layers(tiny_path) == (3, 6)
    coordinator = DistOptions.resolved(role="coordinator", addr="127.0.0.1:1", stages=3)
    first, end = coordinator.stage_layers(tiny_path)
    assert first == 0 and 0 < end < 6
    # loaded for its slice, the model itself says which (a split set's part holds only some tensors)
    sliced = open_model(tiny_path, (first, end))
    assert coordinator.slice_for(sliced) == LayerSlice(first, end, 6)


def test_triton_stages_upload_only_their_layers(tiny_path):
    """Uploads only (the interpreter's forward pass takes a minute here; the route tests run the reference)."""
    from dwarfstar.backends.triton.backend import TritonBackend

    full_file = logged(tiny_path, None)
    full = TritonBackend.from_model_file(full_file, device="cpu", max_seq_len=CTX)
    n = full.args.n_layers
    files = [logged(tiny_path, (0, SPLIT)), logged(tiny_path, (SPLIT, n))]
    stages = [TritonBackend.from_model_file(f, device="cpu", max_seq_len=CTX) for f in files]
    for f, stage in zip(files, stages, strict=True):
        assert f.gguf.names == stage_tensors(f, stage.layer_range)
        assert sorted(stage.w.layers) == list(stage.layer_range)
        assert list(stage.new_state().cache.blocks[0]) == list(stage.layer_range)
    first, last = stages
    assert first.w.embed is not None and first.w.output is None and first.w.head_hc is None
    assert last.w.embed is None and last.w.output is not None
    assert first.w.nbytes + last.w.nbytes == full.w.nbytes
    assert files[0].gguf.names | files[1].gguf.names == full_file.gguf.names
    # a stage runs the backend itself: the shared forward pass's entry points, eagerly
    engine = Engine(files[1], last, "triton", None, 0.0)
    assert local_model(engine, LayerSlice(SPLIT, n, n)) is last


def test_mlx_stages_pack_only_their_layers_and_chain_to_the_same_logits(tiny_path):
    pytest.importorskip("mlx.core")
    from dwarfstar.backends.mlx.model import MLXModel

    full = MLXModel(open_model(tiny_path), max_seq_len=CTX)
    n = full.args.n_layers
    want = full.forward(PROMPT, full.new_state(), all_logits=True)
    files = [logged(tiny_path, (0, SPLIT)), logged(tiny_path, (SPLIT, n))]
    stages = [MLXModel(f, max_seq_len=CTX) for f in files]
    got, states = chain(stages, PROMPT)
    assert torch.equal(got, want)
    for f, stage, state in zip(files, stages, states, strict=True):
        assert f.gguf.names == stage_tensors(f, stage.layer_range)
        assert sorted(stage.ops.layers) == list(stage.layer_range) == list(state.cache.blocks[0])
    assert stages[0].ops.output is None and stages[1].ops.embedding is None
