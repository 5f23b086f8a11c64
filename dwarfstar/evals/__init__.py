"""ds4's gates and capability eval: `dwarfstar test vectors|long-context|tool-call|quality` and `dwarfstar eval`.

The gates (`vectors.py`, `long_context.py`, `tool_call.py`, `quality.py`) tell whoever holds real
weights whether kernels, quantization, rendering, the KV cache and tool streaming still work; the eval
(`questions.py`, `graders.py`, `runner.py`, `eval_trace.py`, `tui.py`) runs a question set with ds4-eval's
prompts, graders, thinking budgets and trace format. `../shared/spec/DS4_SURFACE.md` §1.6, §1.7, §5.1,
§5.3 and §5.4 give ds4's semantics, which these modules follow.
"""

from pathlib import Path

from dwarfstar.errors import DwarfStarError

DEFAULT_TOKENS = 16000  # ds4-eval's -n
BUNDLED_SET = Path(__file__).resolve().parent.parent / "data" / "evals" / "dwarfstar_v1.jsonl"


class EvalError(DwarfStarError):
    """A gate or eval input (vector file, prompt, fixture, question set, trace) is missing or malformed."""


def read_input(path: Path, what: str) -> str:
    """The text of an eval input file; one that cannot be read or is not UTF-8 is an `EvalError`
    naming `what` it is ("question set", "prompt file", ...)."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"cannot read {what} {path}: {exc}") from None
