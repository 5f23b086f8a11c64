"""Bad input to expert streaming is a clear error: an unreadable file, a file truncated inside an
expert, a budget smaller than one token's experts, a model too big to hold without the flag."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from dwarfstar.backends import registry
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.experts.attach import StreamingOptions, check_fits, plan_capacity
from dwarfstar.experts.layout import BudgetError, ExpertLayout
from dwarfstar.experts.policy import LRUPolicy
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import open_model

REFERENCE = registry.backend_entry("reference")


@pytest.fixture(scope="module")
def model_file(tiny_k_path):
    return open_model(tiny_k_path)


@pytest.fixture(scope="module")
def layout(model_file) -> ExpertLayout:
    return ExpertLayout.of(model_file.gguf, model_file.args)


def test_missing_file(layout, tmp_path):
    gone = dataclasses.replace(layout, path=str(tmp_path / "gone.gguf"))
    with pytest.raises(ModelFileError, match="cannot open for expert streaming"):
        ExpertStore(gone, 4, LRUPolicy())


def test_unreadable_path(layout, tmp_path):
    store = ExpertStore(dataclasses.replace(layout, path=str(tmp_path)), 4, LRUPolicy())  # a directory
    try:
        store.request(0, 0)
        with pytest.raises(ModelFileError, match="cannot read expert 0 of layer 0"):
            store.get(0, 0)
        assert not store.resident(0, 0)
    finally:
        store.close()


@pytest.mark.parametrize("direct", [False, True], ids=["pread", "o_direct"])
def test_file_truncated_inside_an_expert(layout, tiny_k_path, tmp_path, direct):
    layer, e = 3, 5
    down = layout.expert(layer, e)[2]
    cut = tmp_path / "cut.gguf"
    shutil.copy(tiny_k_path, cut)
    with open(cut, "r+b") as f:
        f.truncate(down.offset + down.nbytes // 2)  # the file ends halfway through this expert's down slab
    store = ExpertStore(dataclasses.replace(layout, path=str(cut)), 4, LRUPolicy(), direct=direct)
    try:
        store.begin_step(1)
        store.request(0, 0)  # wholly before the cut: reads fine
        assert len(store.get(0, 0).data[2]) == layout.expert(0, 0)[2].nbytes
        store.request(layer, e)
        with pytest.raises(ModelFileError, match=f"truncated inside expert {e} of layer {layer} .ffn_down_exps"):
            store.get(layer, e)
        assert not store.resident(layer, e)  # no half-read expert stays behind
    finally:
        store.close()


def test_budget_smaller_than_one_tokens_experts(model_file, layout):
    with pytest.raises(BudgetError, match="smaller than the 2 one token uses"):
        ExpertStore(layout, 1, LRUPolicy())
    one_expert = f"{layout.max_expert_bytes + 1}"
    options = StreamingOptions(cache_experts=one_expert)
    with pytest.raises(BudgetError, match=f"--ssd-streaming-cache-experts {one_expert} holds 1 experts"):
        plan_capacity(model_file, layout, REFERENCE, 256, options)
    # a budget above the whole file holds every expert, no more
    assert plan_capacity(model_file, layout, REFERENCE, 256, StreamingOptions(cache_experts="1GB")) == 6 * 8


def test_too_big_without_the_flag_names_it(model_file, layout, monkeypatch):
    check_fits(model_file, REFERENCE, 256)  # fits in this machine's memory
    monkeypatch.setattr(registry.Reference, "usable_memory", lambda self: 1 << 20)
    with pytest.raises(DwarfStarError, match="run with --ssd-streaming"):
        check_fits(model_file, REFERENCE, 256)
    with pytest.raises(BudgetError, match="the automatic budget"):
        plan_capacity(model_file, layout, REFERENCE, 256, StreamingOptions())
