"""A DSpark support file as ds4's quantizer writes it, its stages' routers in Q8_0: it loads, and drafts
exactly as the same drafter with those routers stored as the floats gguf-py decodes them to."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.synthetic import TINY, write_synthetic_dspark
from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.speculative.dspark import DSparkDraft
from dwarfstar.speculative.mtp import forward_of

D = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)
CONTEXT = list(range(2000, 2024))
ROUTER = "ffn_gate_inp.weight"


def copy_with_routers(src, dst, quantized: bool) -> int:
    """`src` with each stage's router in Q8_0 (`quantized`) or as gguf-py's decoding of that Q8_0; the
    count of routers changed."""
    source = GGUFFile(src)
    meta = {"general.architecture": (ValueType.STRING, source.metadata["general.architecture"])}
    for key, value in source.metadata.items():
        if key.startswith("dspark."):
            meta[key] = (
                (ValueType.ARRAY, (ValueType.UINT32, list(value)))
                if isinstance(value, list)
                else (ValueType.UINT32, value)
            )
    routers = [name for name in source.tensors if name.endswith(ROUTER)]
    data = {}
    for name in routers:
        values = source.tensor(name).numpy().astype(np.float32)
        q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        data[name] = q8 if quantized else gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
    with GGUFWriter(dst, meta) as writer:
        for name, info in source.tensors.items():
            kind = (GGMLType.Q8_0 if quantized else GGMLType.F32) if name in data else info.ggml_type
            writer.add_tensor(name, tuple(info.shape), kind)
        for name in source.tensors:
            raw = np.ascontiguousarray(data[name]).reshape(-1).view(np.uint8) if name in data else source.raw(name)
            writer.write_tensor(name, iter([raw]))
    source.close()
    return len(routers)


@pytest.fixture(scope="module")
def files(tiny_model_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    support, q8, floats = root / "f32.gguf", root / "q8.gguf", root / "floats.gguf"
    write_synthetic_dspark(support, TINY, D, seed=3)
    assert copy_with_routers(support, q8, quantized=True) == D.stages
    copy_with_routers(support, floats, quantized=False)
    return tiny_model_file(0), q8, floats


def draft_of(model_path, support, backend: str):
    engine = load_engine(EngineSpec(model_path, backend=backend, ctx=256))
    target = forward_of(engine.backend)
    draft = DSparkDraft(target, engine.model, support)
    captured = {}
    target.taps.append(lambda il, h, batch: captured.__setitem__(il, h))
    target.forward(CONTEXT, target.new_state())
    state = draft.new_state()
    draft.feed([captured[il] for il in D.target_layers], state)
    collapsed, logits = draft.forward.block(4242, state)
    drafts, _ = draft.propose(4242, state, D.block_size, Sampler(GREEDY))
    return collapsed, logits, drafts


def test_a_support_file_with_q8_0_routers_drafts_as_their_floats_do(files, backend_name):
    """Every backend loads a router in whatever type its file holds; a Q8_0 one routes as its floats do."""
    model_path, q8, floats = files
    assert GGUFFile(q8).tensors[f"mtp.0.{ROUTER}"].ggml_type is GGMLType.Q8_0
    have, want = draft_of(model_path, q8, backend_name), draft_of(model_path, floats, backend_name)
    assert np.array_equal(np.asarray(have[0]), np.asarray(want[0]))
    assert np.array_equal(np.asarray(have[1]), np.asarray(want[1]))
    assert have[2] == want[2]
