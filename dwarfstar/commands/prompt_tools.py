"""`dwarfstar tokens`, `dwarfstar render` and `dwarfstar bench tokenizer`: the tokenizer and prompt layer
from the command line.

`dwarfstar render ... > p.txt && dwarfstar tokens -m M --special --text-file p.txt` gives the ids the model
sees, as long as the conversation's own text holds no control-token strings (the renderer keeps those
plain; `--special` cannot tell them apart in a flat file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

import dwarfstar
from dwarfstar.commands.apps import TOOLS, app, bench_app
from dwarfstar.errors import DwarfStarError

if TYPE_CHECKING:
    from dwarfstar.tokenizer import Tokenizer

# The official V4 vocabulary size; the bundled tokenizer.json defines exactly these ids.
BUNDLED_VOCAB_SIZE = 129280
BENCH_TEXT = Path("fixtures") / "text" / "promessi_sposi.txt"
EXCERPT = "promessi_sposi_excerpt.txt"  # dwarfstar/data: its first pages, for a checkout without ../shared


class InputFileError(DwarfStarError):
    """A file named on the command line is missing, unreadable or not in the expected format."""


def _read_bytes(path: Path) -> bytes:
    if str(path) == "-":
        return sys.stdin.buffer.read()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputFileError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_text_file(path: Path) -> str:
    """A text file named on the command line (`-`: stdin), bytes that are not UTF-8 replaced."""
    return _read_bytes(path).decode("utf-8", errors="replace")


def load_tokenizer(model: Path | None) -> Tokenizer:
    from dwarfstar.tokenizer import Tokenizer
    from dwarfstar.tokenizer.vocab import bundled_tokenizer_json

    if model is None:
        return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), BUNDLED_VOCAB_SIZE)
    return Tokenizer.from_gguf(model)


def load_conversation(path: Path) -> dict[str, Any]:
    """`{"messages": [...], "tools"?: [...], "response_format"?: {...}}`, or a bare messages list."""
    from dwarfstar.prompt import PromptError

    try:
        data = json.loads(_read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InputFileError(f"{path} is not JSON: {exc}") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or "messages" not in data:
        raise PromptError(f'{path} must hold {{"messages": [...]}} or a list of messages')
    return data


@app.command(rich_help_panel=TOOLS)
def tokens(
    text_file: Annotated[Path, typer.Option("--text-file", help="Text to tokenize ('-' reads stdin).")],
    model: Annotated[
        Path | None, typer.Option("-m", "--model", help="GGUF model whose tokenizer to use (default: official V4).")
    ] = None,
    special: Annotated[
        bool, typer.Option("--special", help="Turn DeepSeek control-token strings in the text into control tokens.")
    ] = False,
) -> None:
    """Print the token ids of a text file on one line, separated by spaces."""
    tokenizer = load_tokenizer(model)
    text = _read_bytes(text_file).decode("utf-8", errors="replace")
    ids = tokenizer.encode_with_specials(text) if special else tokenizer.encode(text)
    typer.echo(" ".join(map(str, ids)))


@app.command(rich_help_panel=TOOLS)
def render(
    messages_file: Annotated[
        Path, typer.Option("--messages-file", help='JSON {"messages": [...], "tools"?, "response_format"?}.')
    ],
    thinking: Annotated[bool, typer.Option("--thinking", help="Thinking mode (default: chat mode).")] = False,
    reasoning_effort: Annotated[
        str | None,
        typer.Option("--reasoning-effort", help="low, high or max: the release's preamble in thinking mode, if any."),
    ] = None,
    release: Annotated[
        str,
        typer.Option(help="Whose effort table: preview (V4 as first published) or 0731 (Flash 0731, PRO 0813)."),
    ] = "preview",
    ds4: Annotated[bool, typer.Option("--ds4", help="Render as ds4's server does, not the official way.")] = False,
) -> None:
    """Print the rendered DeepSeek V4 prompt, byte for byte (no newline is added)."""
    from dataclasses import replace

    from dwarfstar.model.config import RELEASES
    from dwarfstar.prompt import DS4, OFFICIAL, render_conversation

    if release not in RELEASES:
        raise DwarfStarError(f"--release must be one of {', '.join(RELEASES)}, got {release!r}")

    request = load_conversation(messages_file)
    prompt = render_conversation(
        request["messages"],
        tools=request.get("tools"),
        response_format=request.get("response_format"),
        thinking=thinking,
        reasoning_effort=reasoning_effort,
        options=replace(DS4 if ds4 else OFFICIAL, efforts=release),
    )
    sys.stdout.buffer.write(prompt.text.encode("utf-8"))
    sys.stdout.buffer.flush()


def default_bench_text() -> Path:
    """The whole book where `shared/` sits beside the checkout (as CI lays it out), else its first
    pages, shipped in the package."""
    package = Path(dwarfstar.__file__).resolve().parent
    for shared in (package.parents[1] / "shared", Path.cwd().parent / "shared", Path.cwd() / "shared"):
        if (shared / BENCH_TEXT).is_file():
            return shared / BENCH_TEXT
    return package / "data" / EXCERPT


@bench_app.command("tokenizer")
@app.command("bench-tokenizer", hidden=True)  # its first name, kept for scripts
def bench_tokenizer(
    text_file: Annotated[
        Path | None, typer.Option("--text-file", help="Benchmark text (default: the book, or its packaged pages).")
    ] = None,
    model: Annotated[Path | None, typer.Option("-m", "--model", help="GGUF model whose tokenizer to use.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs; the best one counts.")] = 3,
) -> None:
    """Encode speed against HF tokenizers on the official tokenizer.json, and a 100-message render+tokenize."""
    from dwarfstar.prompt.tokenize_bench import run_bench
    from dwarfstar.tokenizer.vocab import bundled_tokenizer_json

    path = text_file or default_bench_text()
    text = _read_bytes(path).decode("utf-8", errors="replace")
    result = run_bench(load_tokenizer(model), bundled_tokenizer_json(), text, repeats)
    typer.echo(f"text: {path.name}, {result.text_bytes / 1e6:.2f} MB, {result.tokens} tokens")
    typer.echo(f"ids identical to the official tokenizer: {'yes' if result.ids_match else 'NO'}")
    typer.echo(f"encode dwarfstar:                         {result.ours_mb_s:7.2f} MB/s")
    typer.echo(f"encode tokenizers + official json:        {result.official_mb_s:7.2f} MB/s")
    typer.echo(f"ratio (goal >= 0.9):                      {result.ratio:7.2f}")
    typer.echo(
        f"agent conversation: {result.agent_messages} messages, {result.agent_tokens} tokens: "
        f"render {result.render_ms:.1f} ms + tokenize {result.tokenize_ms:.1f} ms"
    )
    if not result.ids_match:
        raise DwarfStarError("the tokenizer disagrees with the official one on the benchmark text")
