"""What `--mtp`, `--mtp-draft`, `--mtp-margin` and `--mtp-align` choose, for `run`, `serve` and `bench`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dwarfstar.engine import Engine
from dwarfstar.model.bundled import default_model_path
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator, check_settings
from dwarfstar.speculative.mtp import MTPDraft, load_draft

BUNDLED_MTP = "nano-mtp.gguf"  # tools/train_nano.py --mtp
DEFAULT_DRAFT = 2  # --mtp without --mtp-draft


@dataclass(frozen=True)
class MTPOptions:
    path: Path | None
    n_draft: int
    margin: float = 0.0
    alignment: str = "next"

    def __post_init__(self) -> None:
        check_settings(self.n_draft, self.alignment, self.margin)

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

    def load(self, engine: Engine) -> MTPSpeculation:
        """The engine's MTP draft, loaded once, with these settings."""
        return MTPSpeculation(self, load_draft(engine.backend, engine.model, self.file_for(engine.model.path)))

    def speculator(self, engine: Engine, ctx: int) -> Speculator:
        return self.load(engine).start(Session(engine.backend, ctx=ctx))


@dataclass(frozen=True)
class MTPSpeculation:
    """A loaded draft and its settings: a speculator for any session of its target (a server's)."""

    options: MTPOptions
    draft: MTPDraft

    def start(self, session: Session) -> Speculator:
        o = self.options
        return Speculator(session, self.draft, o.n_draft, o.alignment, o.margin)
