"""The cpu backend (`--backend cpu`): the reference's forward, KV and sampling, with its weight products on
the CPU kernels. The conformance suite runs it on the tiny float model (tests/backends); here it runs
on quantized files, against the reference, and through the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dwarfstar
from dwarfstar.backends.cpu import native
from dwarfstar.backends.cpu.products import KernelProducts
from dwarfstar.backends.reference.weights import FLOAT32
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.attach import StreamingOptions
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

BOOK = Path(dwarfstar.__file__).parent / "data" / "promessi_sposi_excerpt.txt"
PROMPT = torch.randint(3, 120000, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """tiny-k in ds4's layout (Q8_0 attention, IQ2_XXS gate/up and Q2_K down experts) and with MXFP4 experts."""
    folder = tmp_path_factory.mktemp("cpu")
    out = {}
    for layout in ("ds4", "ds4-mxfp4"):
        out[layout] = folder / f"tiny-k-{layout}.gguf"
        write_synthetic_model(out[layout], TINY_K, layout, seed=2)
    return out


def logits(path: Path, backend: str, tokens: list[int], **spec) -> torch.Tensor:
    engine = load_engine(EngineSpec(path, backend, **spec))
    return engine.backend.forward(tokens, engine.backend.new_state())


def test_nano_follows_the_reference() -> None:
    """The int8 activations' effect on the bundled model (Q8_0 products), over 256 tokens of the book:
    mean KL(reference || cpu) 0.0021 nats and 96.9% of the top-1 tokens the same when this was written;
    a decoding or scaling fault moves these by orders of magnitude."""
    engine = load_engine(EngineSpec(default_model_path(), "reference"))
    tokens = engine.tokenizer.encode(BOOK.read_text())[:256]
    want = engine.backend.forward(tokens, engine.backend.new_state()).double()
    got = logits(default_model_path(), "cpu", tokens).double()
    log_p = want.log_softmax(-1)
    kl = (log_p.exp() * (log_p - got.log_softmax(-1))).sum(-1).mean().item()
    same = (want.argmax(-1) == got.argmax(-1)).double().mean().item()
    assert kl < 0.01 and same > 0.9, (kl, same)


@pytest.mark.parametrize("layout", ["ds4", "ds4-mxfp4"])
def test_decode_steps_are_the_prompt_rows(files, layout) -> None:
    """A token decoded alone has the bits of its row in a whole-prompt pass (the products quantize and
    sum each row alike whatever shares the call), with two threads."""
    engine = load_engine(EngineSpec(files[layout], "cpu", threads=2))
    backend = engine.backend
    assert isinstance(backend.ops.products, KernelProducts)
    whole = backend.forward(PROMPT, backend.new_state())
    state = backend.new_state()
    backend.forward(PROMPT[:30], state)
    for i in range(30, len(PROMPT)):
        assert torch.equal(backend.forward(PROMPT[i : i + 1], state)[0], whole[i]), i


def test_thread_count_changes_no_bit(files) -> None:
    one = logits(files["ds4"], "cpu", PROMPT, threads=1)
    assert torch.equal(one, logits(files["ds4"], "cpu", PROMPT, threads=2))


def test_streamed_experts_give_the_resident_logits(files) -> None:
    """Experts read through the expert store (a cache of a few experts) compute what the mapped file does."""
    streaming = StreamingOptions(cache_experts="400KB", cold=True)
    resident = logits(files["ds4"], "cpu", PROMPT)
    assert torch.equal(logits(files["ds4"], "cpu", PROMPT, ctx=512, streaming=streaming), resident)


def test_cli_runs_the_cpu_backend(files) -> None:
    def run(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "dwarfstar", "run", "-m", str(files["ds4"]), "--backend", "cpu", *flags]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    done = [run("--threads", n, "--temp", "0", "-n", "8", "-p", "ciao") for n in ("1", "2")]
    assert all(d.returncode == 0 for d in done), done[0].stderr
    # the reply, without the timing line
    texts = [(d.stdout + d.stderr).split("\nload ")[0] for d in done]
    assert texts[0] == texts[1] and texts[0].strip()
    bad = run("--threads", "0", "-p", "ciao")
    assert bad.returncode == 2 and "--threads" in bad.stderr and "Traceback" not in bad.stderr


def test_threads_must_be_positive(files) -> None:
    with pytest.raises(DwarfStarError, match="--threads must be at least 1"):
        EngineSpec(files["ds4"], "cpu", threads=0)


def test_without_a_compiler_it_runs_the_reference_products(files, monkeypatch, tmp_path, capfd) -> None:
    """No compiler: said once on stderr, and the products are the reference's float32 ones (same bits)."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DWARFSTAR_CACHE", str(tmp_path / "cache"))
    native.kernels.cache_clear()
    native.available.cache_clear()
    try:
        engine = load_engine(EngineSpec(files["ds4"], "cpu"))
        assert engine.backend.ops.products is FLOAT32
        assert "CPU kernels unavailable" in capfd.readouterr().err
        got = engine.backend.forward(PROMPT, engine.backend.new_state())
    finally:
        native.kernels.cache_clear()
        native.available.cache_clear()
    assert torch.equal(got, logits(files["ds4"], "reference", PROMPT))


def test_auto_takes_the_kernels_for_big_files(monkeypatch) -> None:
    """`auto` without a GPU: the reference for a small file (the bundled model), the cpu backend from
    1 GiB (a real model), where the kernels build."""
    from dwarfstar.backends import registry

    monkeypatch.setattr(registry.Triton, "preferred", lambda self, model_bytes=0: False)
    monkeypatch.setattr(registry.MLX, "preferred", lambda self, model_bytes=0: False)
    assert registry.pick_backend("auto", default_model_path().stat().st_size) == "reference"
    assert registry.pick_backend("auto", 9_507_309_792) == "cpu"
    monkeypatch.setattr(native, "available", lambda: "no compiler")
    assert registry.pick_backend("auto", 9_507_309_792) == "reference"


def test_an_unusable_cache_folder_builds_in_the_temporary_one(monkeypatch, tmp_path) -> None:
    """Where the cache folder cannot be made (here a file stands in its way; a read-only home alike),
    the kernels build in the temporary folder."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("DWARFSTAR_CACHE", str(blocker))
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path / "tmp"))
    native.kernels.cache_clear()
    try:
        assert native.kernels().ds_simd() >= 0
    finally:
        native.kernels.cache_clear()
    assert list((tmp_path / "tmp").glob("dwarfstar-cpu-kernels-*/kernels-*.so"))
