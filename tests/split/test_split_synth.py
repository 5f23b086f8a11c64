"""`dwarfstar synth --split-at` writes a model as ds4-named parts, and the `pro-shaped` preset has
the PRO layers' exact tensor shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dwarfstar.cli import main
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import PRESETS
from dwarfstar.model.tensors import expected_tensors


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["dwarfstar", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


def test_synth_split_at_writes_the_same_tensors_as_parts(tmp_path: Path, monkeypatch, capsys) -> None:
    assert run_cli(monkeypatch, "synth", str(tmp_path / "whole.gguf"), "--seed", "3") == 0
    split = ("--split-at", "2", "--split-at", "4")
    assert run_cli(monkeypatch, "synth", str(tmp_path / "t.gguf"), "--seed", "3", *split) == 0
    parts = sorted(p.name for p in tmp_path.glob("t*.gguf"))
    assert parts == ["t-Layers-02-03.gguf", "t-Layers-04-output.gguf", "t-Layers00-01.gguf"]  # and no whole file
    assert "wrote" in capsys.readouterr().out
    model = open_model(tmp_path / "t-Layers-02-03.gguf")
    with GGUFFile(tmp_path / "whole.gguf") as whole:
        assert model.gguf.tensors.keys() == whole.tensors.keys()
        for name in ("token_embd.weight", "blk.3.ffn_gate_exps.weight", "output.weight"):
            assert bytes(model.gguf.raw(name)) == bytes(whole.raw(name))
    model.close()

    assert run_cli(monkeypatch, "synth", str(tmp_path / "bad.gguf"), "--split-at", "6") == 2
    assert "--split-at must name layers 1 to 5 of the 6-layer tiny" in capsys.readouterr().err
    assert not list(tmp_path.glob("bad*"))


def test_only_a_one_part_set_reads_by_offset_in_one_file(tmp_path: Path, monkeypatch) -> None:
    """Expert streaming reads by file offset: a stage on one part may, the whole set across two may not."""
    assert run_cli(monkeypatch, "synth", str(tmp_path / "t.gguf"), "--split-at", "3") == 0
    stage = open_model(tmp_path / "t-Layers00-02.gguf", layers=(3, 6))
    assert stage.gguf.path == tmp_path / "t-Layers-03-output.gguf"
    stage.close()
    whole = open_model(tmp_path / "t-Layers00-02.gguf")
    with pytest.raises(ModelFileError, match=r"spans 2 files, and this reads tensors by offset in one file"):
        _ = whole.gguf.path
    whole.close()


def test_the_pro_shaped_preset_has_the_pro_layers_shapes() -> None:
    """Its layer 0 is PRO's layer 0 (ratio 128, hash-routed), its layer 1 PRO's layer 4 (ratio 4, learned)."""
    pro, shaped = ModelArgs.pro(), PRESETS["pro-shaped"]

    def layer(args: ModelArgs, il: int) -> dict[str, tuple[tuple[int, ...], frozenset]]:
        prefix = f"blk.{il}."
        specs = [s for s in expected_tensors(args) if s.name.startswith(prefix)]
        return {s.name.removeprefix(prefix): (s.shape, s.types) for s in specs}

    assert layer(shaped, 0) == layer(pro, 0)
    assert layer(shaped, 1) == layer(pro, 4)
    assert shaped.layer(0).hash_routed and not shaped.layer(1).hash_routed
    assert (shaped.dim, shaped.n_heads, shaped.n_routed_experts, shaped.moe_inter_dim) == (7168, 128, 384, 3072)
    outside = {s.name: s.shape for s in expected_tensors(shaped) if not s.name.startswith("blk.")}
    assert outside == {s.name: s.shape for s in expected_tensors(pro) if not s.name.startswith("blk.")}


def test_run_on_a_split_set_gives_the_single_files_reply(tmp_path: Path, monkeypatch, capsys) -> None:
    """`run -m` on any part of a set loads the whole set (the memory check sums the routed experts
    of every part) and answers exactly as the single file does."""
    assert run_cli(monkeypatch, "synth", str(tmp_path / "whole.gguf"), "--seed", "5") == 0
    assert run_cli(monkeypatch, "synth", str(tmp_path / "t.gguf"), "--seed", "5", "--split-at", "3") == 0
    capsys.readouterr()
    replies = []
    for path in (tmp_path / "whole.gguf", tmp_path / "t-Layers-03-output.gguf"):
        argv = ("run", "-m", str(path), "--backend", "reference", "--prompt-tokens", "0,17,4242,99", "-n", "4")
        assert run_cli(monkeypatch, *argv, "--temp", "0", "--nothink") == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] == replies[1] and replies[0].strip()
