"""`synth --layers N`: a preset's dimensions with another layer count, as the larger-than-RAM benchmark
file is written (`--preset flash-shaped --layers 14`), and the loader accepts the file."""

from __future__ import annotations

from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, preset_with_layers

_register_commands()


def test_synth_writes_the_preset_with_another_layer_count(tmp_path):
    out = tmp_path / "tiny3.gguf"
    done = CliRunner().invoke(app, ["synth", str(out), "--preset", "tiny", "--layers", "3"])
    assert done.exit_code == 0, done.output
    args = open_model(out).args
    # Flash's pattern: two window-only layers, then ratio 4; every layer of three is hash-routed
    assert (args.n_layers, args.compress_ratios, args.n_hash_layers) == (3, (0, 0, 4), 3)
    assert (args.dim, args.n_routed_experts) == (TINY.dim, TINY.n_routed_experts)


def test_a_pro_shaped_preset_keeps_pros_pattern():
    args = preset_with_layers("pro-shaped", 5)
    assert args.compress_ratios == (128, 128, 4, 128, 4) and args.n_hash_layers == 3
