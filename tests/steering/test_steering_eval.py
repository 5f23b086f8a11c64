"""`dwarfstar steer build` and `steer eval` on the bundled model: a direction built from the book's long
sentences against its short ones, measured on other short and long sentences at scales -2..2.

What must hold, on both evaluation sets:
* at scale 0 the long sentences project further along the direction than the short ones (the
  direction measures the property it was built from, on sentences it was not built from);
* the projection the residual streams receive falls strictly as the scale grows (positive removes
  the direction, negative amplifies it);
* on the long sentences, the projection arriving at each layer, which only the earlier layers'
  steering moves, is lower at +2 than at -2. Not on the short ones: there the direction is weak,
  and the later layers of the bundled model (retrained with tool calls and thinking turns) write back
  part of what the earlier ones removed, so what arrives rises a little with the scale.
Measured (reference backend, 6 + 6 prompts), from -2 to 2, `projection out`: short 1.48, 1.37,
0.90, 0.00, -0.96; long 9.50, 5.51, 2.21, 0.00, -1.65; `projection in`: short 0.49, 0.68, 0.90,
0.91, 0.96; long 3.17, 2.76, 2.21, 1.79, 1.65.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.bundled import default_model_path

_register_commands()
CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
SCALES = [-2.0, -1.0, 0.0, 1.0, 2.0]
N_BUILD, N_EVAL, EVAL_FROM = 24, 6, 100  # evaluation sentences come from further into the book
ROW = re.compile(r"^\s*(-?[\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+(-?[\d.]+)\s")


def book_sentences() -> tuple[list[str], list[str]]:
    """Sentences of the novel (from chapter I on): short ones of 4-8 words, long ones of 35-60."""
    text = CORPUS.read_text(encoding="utf-8")
    flat = re.sub(r"\s+", " ", text[text.index("CAPITOLO I") :])
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", flat)]
    # drop the editor's italics and the illustration captions
    sentences = [s for s in sentences if s and s[0].isupper() and "_" not in s and "[" not in s]
    short = [s for s in sentences if 4 <= len(s.split()) <= 8]
    long = [s for s in sentences if 35 <= len(s.split()) <= 60]
    return short, long


def cli(*args: str) -> str:
    done = CliRunner().invoke(app, [*args])
    assert done.exit_code == 0, done.output
    return done.output


@pytest.fixture(scope="module")
def direction(tmp_path_factory) -> tuple[Path, Path, Path]:
    short, long = book_sentences()
    folder = tmp_path_factory.mktemp("steer")
    files = {}
    for name, lines in [
        ("good", long[:N_BUILD]),
        ("bad", short[:N_BUILD]),
        ("eval_short", short[EVAL_FROM : EVAL_FROM + N_EVAL]),
        ("eval_long", long[EVAL_FROM : EVAL_FROM + N_EVAL]),
    ]:
        files[name] = folder / f"{name}.txt"
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = folder / "long.f32"
    model = ["-m", str(default_model_path()), "--backend", "reference"]
    cli("steer", "build", "--good", str(files["good"]), "--bad", str(files["bad"]), "-o", str(out), *model)
    return out, files["eval_short"], files["eval_long"]


def evaluate(direction: Path, prompts: Path) -> dict[float, tuple[float, float, float]]:
    """scale -> (mean length, projection in, projection out), from `steer eval`'s table."""
    scales = ",".join(f"{s:g}" for s in SCALES)
    output = cli(
        "steer", "eval", str(direction), "--prompts", str(prompts), f"--scales={scales}", "-n", "4",
        "-m", str(default_model_path()), "--backend", "reference",
    )  # fmt: skip
    rows = {float(m[1]): (float(m[2]), float(m[3]), float(m[4])) for m in map(ROW.match, output.splitlines()) if m}
    assert sorted(rows) == SCALES, output
    return rows


def test_projection_moves_monotonically_with_the_scale(direction):
    path, short_prompts, long_prompts = direction
    short, long = evaluate(path, short_prompts), evaluate(path, long_prompts)
    print(f"scale -> (length, projection in, projection out): short {short}, long {long}")
    for rows in (short, long):
        out = [rows[s][2] for s in SCALES]
        assert all(a > b for a, b in zip(out[:-1], out[1:], strict=True)), out
        assert rows[1.0][2] == 0.0  # at 1 the component along the direction is removed
    assert long[2.0][1] < long[-2.0][1]
    assert long[0.0][1] > short[0.0][1] > 0
