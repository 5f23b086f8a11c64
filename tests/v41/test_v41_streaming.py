"""`--ssd-streaming` with DeepSeek V4.1 (issue 33): `v41-tiny`'s routed experts read through V4's expert
store give the resident run's logits bit for bit, as V4's streaming tests demand, on every backend V4
streams on (the reference, the cpu backend's kernels, Triton in its interpreter, MLX's exact packing):
with a cache of one token's experts (2 of the file's 96: the prefill chunk's experts load in a window,
and every miss evicts) and with one that holds every expert. The store's telemetry counts what the
forward asked of it. A budget below one token's experts, a model too big without the flag and the flag
beside --cpu-moe are load-time errors, as they are for V4.
"""

from __future__ import annotations

import pytest
import torch
from test_cli_front import cli
from triton_interpreter import apply_patches

from dwarfstar.backends import registry
from dwarfstar.cli import _register_commands
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.attach import StreamingOptions, resident_bytes
from dwarfstar.experts.layout import BudgetError, ExpertLayout, routed_tensor_names
from dwarfstar.experts.telemetry import summary
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.synthetic_v41 import V41_TINY
from dwarfstar.model.tensors_v41 import engram_table

_register_commands()
apply_patches()  # Triton's interpreter where no GPU runs the kernels (a no-op elsewhere)

PROMPT = [(7919 * i + 101) % 120000 for i in range(12)]
DECODE = [311]
CTX = 256
K, LAYERS = V41_TINY.n_activated_experts, V41_TINY.n_layers
MLX = pytest.mark.skipif(not registry.backend_entry("mlx").available(), reason="MLX does not run here")


@pytest.fixture(scope="module")
def layout(v41_tiny_file) -> ExpertLayout:
    model = open_model41(v41_tiny_file)
    try:
        return ExpertLayout.of(model.gguf, model.args)
    finally:
        model.close()


def engine(path, backend: str, budget: str | None = None) -> Engine:
    streaming = None if budget is None else StreamingOptions(cache_experts=budget)
    return load_engine(EngineSpec(path, backend, ctx=CTX, engram_cache=1, threads=1, streaming=streaming))


def run(loaded: Engine) -> tuple[list[torch.Tensor], list[int]]:
    """The logits after the prompt (one call) and after each decode token, and how many experts the
    store was asked for in each decode step (none without one)."""
    backend, store = loaded.backend, loaded.experts
    state = backend.new_state()
    logits = [backend.forward(PROMPT, state, all_logits=False)]
    asked = []
    for token in DECODE:
        before = 0 if store is None else store.stats.hits + store.stats.misses
        logits.append(backend.forward([token], state, all_logits=False))
        asked.append(0 if store is None else store.stats.hits + store.stats.misses - before)
    return logits, asked


@pytest.fixture(scope="module")
def plain() -> dict[str, list[torch.Tensor]]:
    """Each backend's resident run, made once (`resident`)."""
    return {}


def resident(plain, path, backend: str) -> list[torch.Tensor]:
    if backend not in plain:
        plain[backend] = run(engine(path, backend))[0]
    return plain[backend]


# one token's experts (the least a budget may be) on every backend; every expert on the fast ones (the
# Triton interpreter takes seconds a call: its one-token cache already loads the prefill in a window and
# gathers each decode step's experts in one go, the two ways its pool hands experts over)
CASES = [
    *(pytest.param(backend, "one-token") for backend in ("reference", "cpu", "triton")),
    pytest.param("mlx", "one-token", marks=MLX),
    *(pytest.param(backend, "every") for backend in ("reference", "cpu")),
    pytest.param("mlx", "every", marks=MLX),
]


@pytest.mark.parametrize(("backend", "budget"), CASES)
def test_streamed_logits_equal_the_resident_run(v41_tiny_file, layout, plain, backend, budget):
    size = layout.max_expert_bytes * K if budget == "one-token" else "1GB"
    loaded = engine(v41_tiny_file, backend, str(size))
    store = loaded.experts
    assert store is not None and loaded.backend.experts.store is store  # the entry attached the engine's store
    try:
        logits, asked = run(loaded)
    finally:
        store.close()
    for got, want in zip(logits, resident(plain, v41_tiny_file, backend), strict=True):
        assert torch.equal(got, want)

    stats = store.stats
    assert stats.tokens == len(PROMPT) + len(DECODE)
    assert asked == [LAYERS * K] * len(DECODE)  # a decode token asks for its k distinct experts a layer
    assert stats.bytes_read == stats.misses * layout.max_expert_bytes > 0  # whole experts, F32 all alike
    uses = stats.hits + stats.misses
    if budget == "one-token":  # each layer's experts evict the last layer's: nothing is ever found again
        assert store.capacity == K and len(store.where) == K
        assert stats.hits == 0 and stats.evictions == stats.misses - K
    else:  # nothing is evicted: one read per expert used, the rest are hits
        assert store.capacity == layout.total_experts == LAYERS * V41_TINY.n_routed_experts
        assert stats.evictions == 0 and stats.misses == len(store.where) and stats.hits == uses - stats.misses > 0
    figures = summary(store)
    assert (figures["hits"], figures["misses"], figures["bytes_read"]) == (stats.hits, stats.misses, stats.bytes_read)
    per_layer = figures["per_layer"]
    assert len(per_layer) == LAYERS and sum(c["hits"] + c["misses"] for c in per_layer) == uses
    assert sum(c["bytes_read"] for c in per_layer) == stats.bytes_read


def test_triton_uploads_no_routed_expert_when_they_stream(v41_tiny_file, layout):
    loaded = engine(v41_tiny_file, "triton", str(layout.max_expert_bytes * K))
    try:
        ops = loaded.backend.transformer.ops
        assert ops.w.routed() == {}  # no routed expert was uploaded: the pool holds the budget
        assert [p.shape[0] for p in loaded.backend.experts.pool] == [K] * 3
    finally:
        loaded.experts.close()


def test_a_budget_below_one_tokens_experts_is_refused(v41_tiny_file, layout):
    one = str(layout.max_expert_bytes * K - 1)
    with pytest.raises(BudgetError, match=f"--ssd-streaming-cache-experts {one} holds 1 experts .* fewer than the 2"):
        engine(v41_tiny_file, "reference", one)


def test_the_fit_counts_the_routed_experts_but_never_the_engram_tables(v41_tiny_file, monkeypatch):
    """Without the flag a model whose routed experts do not fit is refused, naming it; the Engram tables,
    read row by row from the disk, are never counted (it fits in exactly what the rest needs)."""
    model = open_model41(v41_tiny_file)
    entry = registry.backend_entry("cpu")
    try:
        routed = sum(model.gguf.tensors[name].nbytes for name in routed_tensor_names(LAYERS))
        need = routed + resident_bytes(model, entry, CTX)
        engram = sum(model.gguf.tensors[engram_table(il)].nbytes for il in model.engram)
        assert engram > 0 and not any(model.holds(engram_table(il)) for il in model.engram)
    finally:
        model.close()
    monkeypatch.setattr(registry.Cpu, "usable_memory", lambda self: need)
    engine(v41_tiny_file, "cpu")  # it fits exactly
    monkeypatch.setattr(registry.Cpu, "usable_memory", lambda self: need - 1)
    with pytest.raises(DwarfStarError, match="GiB is usable; run with --ssd-streaming to keep the routed experts"):
        engine(v41_tiny_file, "cpu")
    # with the flag the automatic budget (80% of that, less what stays resident) holds no whole expert
    with pytest.raises(BudgetError, match="the automatic budget .* holds 0 experts"):
        load_engine(EngineSpec(v41_tiny_file, "cpu", ctx=CTX, engram_cache=1, streaming=StreamingOptions()))


def test_streaming_beside_cpu_moe_is_refused(v41_tiny_file):
    spec = EngineSpec(v41_tiny_file, "triton", ctx=CTX, cpu_moe="1", streaming=StreamingOptions())
    with pytest.raises(DwarfStarError, match="--cpu-moe and --ssd-streaming both move the routed experts"):
        load_engine(spec)


def test_run_reports_the_expert_cache(monkeypatch, capsys, v41_tiny_file, layout):
    args = ["run", "-m", str(v41_tiny_file), "-p", "hello", "-n", "2", "--backend", "reference", "--temp", "0"]
    args += ["--no-think", "--engram-cache", "1", "--ssd-streaming"]
    code, out, err = cli(monkeypatch, capsys, *args, "--ssd-streaming-cache-experts", str(layout.max_expert_bytes * 4))
    assert code == 0, err
    assert "experts: hit" in err and "resident 4/4" in err
