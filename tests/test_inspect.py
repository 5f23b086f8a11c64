"""`dwarfstar inspect`: tensor table, totals per type, and the weight bytes read per decoded token."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dwarfstar.cli import main
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.synthetic import TINY_K
from dwarfstar.quant.inspection import planned_tensors, token_bytes


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["dwarfstar", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


def test_flash_file_sizes_and_bytes_per_token() -> None:
    """The real Flash shapes under each recipe, against the sizes of ds4's published files."""
    flash = ModelArgs.flash()
    figures = {}
    for recipe in ("q2", "q2-q4", "q4"):
        rows = planned_tensors(flash, recipe)
        figures[recipe] = (sum(t.nbytes for t in rows) / 2**30, token_bytes(rows, 256, 6))
    assert figures["q2"][0] == pytest.approx(81, abs=1)  # ds4: q2 ~81 GiB
    assert figures["q2-q4"][0] == pytest.approx(91, abs=1)  # ds4: "around 91 GB" (GiB, like its 153)
    assert figures["q4"][0] == pytest.approx(153, abs=1)  # ds4: q4 ~153 GiB
    q2 = figures["q2"][1]
    assert q2.total == pytest.approx(9.6e9, rel=0.01)
    # where they go: attention dominates, then the 6 routed experts, the shared expert and the head
    assert q2.by_kind["attention"] > q2.by_kind["routed experts"] > q2.by_kind["shared expert"]
    assert q2.by_kind["output head"] == 129280 * 4096 // 32 * 34  # Q8_0 head, read in full
    assert q2.rows == 4096 * 2 + 3 * 6 * 4  # one F16 embedding row, one I32 hash row in each of 3 layers


def test_token_bytes_reads_the_routed_share_and_single_rows() -> None:
    rows = planned_tensors(TINY_K, "q4")
    got = token_bytes(rows, TINY_K.n_routed_experts, TINY_K.n_activated_experts)
    experts = sum(t.nbytes for t in rows if t.name.endswith("_exps.weight"))
    single = [t for t in rows if t.name == "token_embd.weight" or t.name.endswith("tid2eid.weight")]
    rest = sum(t.nbytes for t in rows) - experts - sum(t.nbytes for t in single)
    assert got.routed == experts * 2 // 8
    assert got.rows == sum(t.nbytes // t.shape[0] for t in single)
    assert got.dense == rest
    assert sum(got.by_kind.values()) == got.total


def test_inspect_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    path = tmp_path / "small.gguf"
    metadata = {
        "general.architecture": (ValueType.STRING, "deepseek4"),
        "deepseek4.expert_count": (ValueType.UINT32, 8),
        "deepseek4.expert_used_count": (ValueType.UINT32, 2),
        "tokenizer.ggml.tokens": (ValueType.ARRAY, (ValueType.STRING, [f"tok{i}" for i in range(20)])),
    }
    tensors = {
        "token_embd.weight": ((20, 256), GGMLType.F16, 20 * 256 * 2),
        "blk.0.attn_q_a.weight": ((64, 256), GGMLType.Q8_0, 64 * 8 * 34),
        "blk.0.ffn_down_exps.weight": ((8, 256, 512), GGMLType.Q2_K, 8 * 256 * 2 * 84),
        "blk.0.ffn_up_exps.weight": ((8, 512, 256), GGMLType.IQ2_XXS, 8 * 512 * 66),
        "output.weight": ((20, 256), GGMLType.Q8_0, 20 * 8 * 34),
    }
    with GGUFWriter(path, metadata) as writer:
        for name, (shape, ggml_type, _) in tensors.items():
            writer.add_tensor(name, shape, ggml_type)
        for name, (_, _, nbytes) in tensors.items():
            writer.write_tensor(name, np.zeros(nbytes, np.uint8))
    assert run_cli(monkeypatch, "inspect", str(path)) == 0
    out = capsys.readouterr().out
    assert "  general.architecture = 'deepseek4'" in out
    assert (
        "  tokenizer.ggml.tokens = ['tok0', 'tok1', 'tok2', 'tok3', 'tok4', 'tok5', 'tok6', 'tok7', … (20 items)]"
        in out
    )
    assert f"{'blk.0.ffn_down_exps.weight':44} {'[8, 256, 512]':>22} {'Q2_K':>8} {344064:>14,}" in out
    assert "  Q2_K         1 tensors     0.344 MB" in out
    assert "  Q8_0         2 tensors    22.848 kB" in out
    assert "  all          5 tensors     0.647 MB" in out
    # a quarter of the experts, one 512-byte embedding row, the projection and the head in full
    per_token = (344064 + 8 * 512 * 66) // 4 + 512 + 64 * 8 * 34 + 20 * 8 * 34
    assert f"bytes read per decoded token (2 of 8 routed experts): {per_token / 1e6:.3f} MB" in out


def test_inspect_other_architectures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    path = tmp_path / "llama.gguf"
    with GGUFWriter(path, {"general.architecture": (ValueType.STRING, "llama")}) as writer:
        writer.add_tensor("w", (2, 32), GGMLType.F32)
        writer.write_tensor("w", np.ones((2, 32), np.float32))
    assert run_cli(monkeypatch, "inspect", str(path)) == 0
    out = capsys.readouterr().out
    assert "F32          1 tensors" in out and "not a deepseek4 file" in out
    assert run_cli(monkeypatch, "inspect", str(tmp_path / "missing.gguf")) == 2
    assert "cannot open model file" in capsys.readouterr().err


def _write_part(path: Path, tensors: dict[str, tuple[tuple[int, ...], GGMLType, int]]) -> None:
    metadata = {
        "general.architecture": (ValueType.STRING, "deepseek4"),
        "deepseek4.block_count": (ValueType.UINT32, 2),
        "deepseek4.expert_count": (ValueType.UINT32, 8),
        "deepseek4.expert_used_count": (ValueType.UINT32, 2),
    }
    with GGUFWriter(path, metadata) as writer:
        for name, (shape, ggml_type, _) in tensors.items():
            writer.add_tensor(name, shape, ggml_type)
        for name, (_, _, nbytes) in tensors.items():
            writer.write_tensor(name, np.zeros(nbytes, np.uint8))


def test_inspect_a_split_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    first, last = tmp_path / "small-Layers00-00.gguf", tmp_path / "small-Layers-01-output.gguf"
    _write_part(
        first,
        {
            "token_embd.weight": ((20, 256), GGMLType.F16, 20 * 256 * 2),
            "blk.0.ffn_down_exps.weight": ((8, 256, 512), GGMLType.Q2_K, 8 * 256 * 2 * 84),
        },
    )
    _write_part(
        last,
        {
            "blk.1.ffn_down_exps.weight": ((8, 256, 512), GGMLType.Q2_K, 8 * 256 * 2 * 84),
            "output.weight": ((20, 256), GGMLType.Q8_0, 20 * 8 * 34),
        },
    )
    assert run_cli(monkeypatch, "inspect", str(last)) == 0  # any part shows the whole set
    out = capsys.readouterr().out
    assert f"split set of 2 parts in {tmp_path}, 4 tensors: complete" in out
    assert f"  {first.name:48} {'layers 0-0':18} GGUF v3     2 tensors     0.354 MB" in out
    assert f"  {last.name:48} {'layers 1-output':18} GGUF v3     2 tensors     0.350 MB" in out
    assert "  all          4 tensors     0.704 MB" in out  # the set's totals, as for one file
    per_token = 2 * 344064 // 4 + 512 + 20 * 8 * 34
    assert f"bytes read per decoded token (2 of 8 routed experts): {per_token / 1e6:.3f} MB" in out

    first.unlink()
    assert run_cli(monkeypatch, "inspect", str(last)) == 0
    out = capsys.readouterr().out
    assert "split set of 1 parts" in out and "INCOMPLETE: missing part for layers 0-0" in out
