"""Prompt files for measuring the nano model: held-out text for `dwarfstar quality`, training text for `imatrix`.

    .venv/bin/python tools/nano_prompts.py OUT_DIR [--heldout-chars N] [--calibration-chars N]

Both are JSON lines of already rendered prompts (BOS, then the plain text), the form the model was
trained and evaluated on: `heldout.jsonl` takes the held-out tail of the corpus from its start,
`calibration.jsonl` paragraphs taken at an even stride over the training text. Prompts are whole paragraphs
joined up to about 1,500 characters (some 450 tokens, within the trained sequence lengths).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dwarfstar.tokenizer.specials import BOS
from dwarfstar.train.corpus import read_split

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
PROMPT_CHARS = 1500


def paragraph_prompts(text: str, limit: int) -> list[str]:
    prompts, current = [], ""
    for paragraph in text.split("\n\n"):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= PROMPT_CHARS:
            prompts.append(current[: 2 * PROMPT_CHARS])
            current = ""
        if sum(map(len, prompts)) >= limit:
            break
    return prompts


def write_jsonl(path: Path, name: str, prompts: list[str]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"id": f"{name}_{i}", "rendered": BOS + text}, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--heldout-chars", type=int, default=30_000)
    parser.add_argument("--calibration-chars", type=int, default=30_000)
    opts = parser.parse_args()
    split = read_split(opts.corpus)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(opts.out_dir / "heldout.jsonl", "heldout", paragraph_prompts(split.heldout, opts.heldout_chars))
    # paragraphs at an even stride, so the calibration sees the whole book
    paragraphs = split.train.split("\n\n")
    stride = max(1, len(split.train) // opts.calibration_chars)
    spread = "\n\n".join(paragraphs[::stride])
    write_jsonl(opts.out_dir / "calibration.jsonl", "calib", paragraph_prompts(spread, opts.calibration_chars))


if __name__ == "__main__":
    main()
