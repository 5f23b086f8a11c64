"""Prompt files for `imatrix` and `quality`, turned into token ids.

Three layouts are read:
* JSON lines, one object per line with "prompt" (user text) and optionally "id", as in ds4's
  gguf-tools/quality-testing/prompts.jsonl; a "rendered" field instead holds an already rendered prompt;
* ds4's rendered imatrix dataset: prompts separated by lines starting with `===== DS4_IMATRIX_PROMPT`;
* plain text: one user prompt per non-empty line.

User text is rendered as a one-turn chat with thinking disabled,
`<｜begin▁of▁sentence｜><｜User｜>{text}<｜Assistant｜></think>`. Text that already starts with the BOS
token is taken as rendered (ds4's rule for `-p`) and tokenized with its special tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import DwarfStarError
from dwarfstar.prompt import render_conversation
from dwarfstar.tokenizer.specials import BOS
from dwarfstar.tokenizer.tokenizer import Tokenizer

DS4_MARKER = "===== DS4_IMATRIX_PROMPT"


@dataclass(frozen=True)
class PromptText:
    id: str
    text: str
    rendered: bool  # True: chat template already applied


def read_prompts(path: str | os.PathLike) -> list[PromptText]:
    path = Path(path)
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DwarfStarError(f"cannot read prompt file {path}: {exc}") from None
    if DS4_MARKER in content:
        blocks = [b.partition("\n")[2].strip() for b in content.split(DS4_MARKER)[1:]]
        prompts = [PromptText(f"prompt_{i}", b, True) for i, b in enumerate(blocks) if b]
    elif content.lstrip().startswith("{"):
        prompts = [_json_prompt(path, n, line) for n, line in enumerate(content.splitlines(), 1) if line.strip()]
    else:
        lines = [line.strip() for line in content.splitlines() if line.strip()]
        prompts = [PromptText(f"prompt_{i}", line, line.startswith(BOS)) for i, line in enumerate(lines)]
    if not prompts:
        raise DwarfStarError(f"prompt file {path} holds no prompts")
    return prompts


def _json_prompt(path: Path, line_no: int, line: str) -> PromptText:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DwarfStarError(f"{path}:{line_no}: not a JSON object: {exc.msg}") from None
    if not isinstance(record, dict):
        raise DwarfStarError(f"{path}:{line_no}: expected a JSON object with a 'prompt' field")
    pid = str(record.get("id", f"prompt_{line_no - 1}"))
    if isinstance(record.get("rendered"), str):
        return PromptText(pid, record["rendered"], True)
    if isinstance(record.get("prompt"), str):
        text = record["prompt"]
        return PromptText(pid, text, text.startswith(BOS))
    raise DwarfStarError(f"{path}:{line_no}: expected a string 'prompt' (or 'rendered') field")


def tokenize_prompt(prompt: PromptText, tokenizer: Tokenizer) -> list[int]:
    if prompt.rendered:
        return tokenizer.encode_with_specials(prompt.text)
    rendered = render_conversation([{"role": "user", "content": prompt.text}], thinking=False)
    return tokenizer.encode_prompt(rendered.parts)
