"""What `--mtp`, `--mtp-draft`, `--mtp-margin` and `--mtp-align` choose, and `--dspark` with
`--dspark-confidence` and `--dspark-strict`, for `run`, `serve`, `agent` and `bench`;
`decode.load_speculation` loads the draft they name. Nothing heavy is imported here, so the command
line states the limits without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.bundled import default_model_path

BUNDLED_MTP = "nano-mtp.gguf"  # tools/train_nano.py --mtp
BUNDLED_DSPARK = "nano-dspark.gguf"  # tools/train_nano.py --dspark
BUNDLED = "bundled"  # `--dspark bundled`: the bundled model's drafter
DEFAULT_DRAFT = 2  # --mtp without --mtp-draft
MAX_DRAFT = 8  # drafts per step: verifying N tokens routes up to 6N experts per layer
MAX_MARGIN = 1000.0  # ds4's range for --mtp-margin
ALIGNMENTS = {"next": 1, "same": 0}  # the paired token's offset from the hidden state's position


# a V4.1 model has no MTP block (`load_engine41`, `decode.load_speculation` refuse --mtp with it)
MTP41_REFUSAL = "--mtp does not run with DeepSeek V4.1: it has no MTP block; its drafter is DSpark (--dspark FILE)"


def check_settings(n_draft: int, alignment: str, margin: float) -> None:
    """The draft count, alignment and margin are usable, else a clear error (named as the flags)."""
    if not 1 <= n_draft <= MAX_DRAFT:
        raise DwarfStarError(f"--mtp-draft must be in 1..{MAX_DRAFT}, got {n_draft}")
    if alignment not in ALIGNMENTS:
        raise DwarfStarError(f"unknown MTP alignment {alignment!r}; choose one of {', '.join(ALIGNMENTS)}")
    if not 0 <= margin <= MAX_MARGIN:
        raise DwarfStarError(f"--mtp-margin must be in 0..{MAX_MARGIN:g}, got {margin}")


@dataclass(frozen=True)
class MTPOptions:
    path: Path | None
    n_draft: int
    margin: float = 0.0
    alignment: str = "next"

    def __post_init__(self) -> None:
        check_settings(self.n_draft, self.alignment, self.margin)

    @property
    def drafts(self) -> bool:
        """Whether decoding speculates (always, with the MTP block)."""
        return True

    def file_for(self, model: Path) -> Path | None:
        """The MTP file to use: --mtp, else for the bundled model its bundled block (it has none in-file)."""
        if self.path is None and model.resolve() == default_model_path().resolve():
            return default_model_path().with_name(BUNDLED_MTP)
        return self.path

    @classmethod
    def from_flags(cls, path: Path | None, n_draft: int | None, margin: float, alignment: str) -> MTPOptions | None:
        """None when speculation is off (no --mtp and no --mtp-draft); --mtp alone drafts DEFAULT_DRAFT."""
        if path is None and n_draft is None:
            return None
        return cls(path, DEFAULT_DRAFT if n_draft is None else n_draft, margin, alignment)

    def describe(self) -> str:
        return f"mtp N={self.n_draft} {self.alignment}"


def check_confidence(confidence: float) -> None:
    """A DSpark confidence cut is usable, else a clear error (named as the flag)."""
    if not 0.0 <= confidence < 1.0:
        raise DwarfStarError(f"--dspark-confidence must be in [0, 1), got {confidence}")


@dataclass(frozen=True)
class DSparkOptions:
    """DSpark speculation: ds4's support file, and the confidence below which a block is cut.

    `strict` (ds4's `--dspark-strict`): the drafter is loaded and checked against the model as for
    speculation, but decoding is the target's alone, one token a step, so the output is byte for byte
    that of a run without `--dspark`: the control of a comparison, and the mode for reproducibility
    checks (a verify pass computes several positions at once, and a backend whose batched kernels
    add in another order than its one-token ones can then differ in the last bits)."""

    path: Path
    confidence: float = 0.0
    strict: bool = False

    def __post_init__(self) -> None:
        check_confidence(self.confidence)

    @property
    def drafts(self) -> bool:
        """Whether decoding speculates: not under `strict`."""
        return not self.strict

    def file_for(self, model: Path) -> Path:
        """The support file: --dspark FILE, or for `--dspark bundled` the bundled model's drafter."""
        if str(self.path) != BUNDLED or self.path.exists():
            return self.path
        if model.resolve() != default_model_path().resolve():
            raise DwarfStarError(
                f"--dspark {BUNDLED} is the drafter of the bundled model; {model.name} needs its own support file "
                "(--dspark FILE)"
            )
        return default_model_path().with_name(BUNDLED_DSPARK)

    def describe(self) -> str:
        return f"dspark confidence {self.confidence:g}" + (" strict (target-only decode)" if self.strict else "")


def speculation_options(
    mtp: MTPOptions | None, dspark: Path | None, confidence: float, strict: bool = False
) -> MTPOptions | DSparkOptions | None:
    """The one drafter the flags choose: the MTP block or DSpark, never both."""
    if dspark is None:
        if confidence:
            raise DwarfStarError("--dspark-confidence needs --dspark FILE")
        if strict:
            raise DwarfStarError("--dspark-strict needs --dspark FILE")
        return mtp
    if mtp is not None:
        raise DwarfStarError("--dspark and --mtp choose two drafters; give one")
    return DSparkOptions(dspark, confidence, strict)
