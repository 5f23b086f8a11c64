"""How far a quantized model's predictions are from a reference's, over a set of prompts.

Both models run every prompt (teacher-forced, from an empty context) in the reference backend. At each
position we compare the next-token distributions:
* KL divergence KL(P_ref ‖ P_test), in nats, averaged over positions;
* top-1 agreement: the fraction of positions where both models' most likely token is the same;
* perplexity of each model on the prompt itself: exp of the mean negative log-likelihood of token t+1
  given tokens ≤ t (the first token, BOS, is context only).
Overall figures weigh every position alike (not every prompt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.loader import ModelFile


@dataclass(frozen=True)
class Quality:
    id: str
    positions: int
    kl: float
    top1: float
    ppl_ref: float
    ppl_test: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


@dataclass
class _Totals:
    positions: int = 0
    kl: float = 0.0
    agree: int = 0
    nll_ref: float = 0.0
    nll_test: float = 0.0
    predicted: int = 0  # positions with a next token (all but the last of each prompt)

    def quality(self, pid: str) -> Quality:
        predicted = max(self.predicted, 1)
        return Quality(
            pid,
            self.positions,
            self.kl / self.positions,
            self.agree / self.positions,
            math.exp(self.nll_ref / predicted),
            math.exp(self.nll_test / predicted),
        )

    def add(self, other: _Totals) -> None:
        for field in ("positions", "kl", "agree", "nll_ref", "nll_test", "predicted"):
            setattr(self, field, getattr(self, field) + getattr(other, field))


def _compare(ref_logits: torch.Tensor, test_logits: torch.Tensor, tokens: torch.Tensor) -> _Totals:
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(test_logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    nxt = tokens[1:]
    return _Totals(
        positions=tokens.numel(),
        kl=float(kl.sum()),
        agree=int((ref_logits.argmax(-1) == test_logits.argmax(-1)).sum()),
        nll_ref=-float(log_p[:-1].gather(1, nxt[:, None]).sum()),
        nll_test=-float(log_q[:-1].gather(1, nxt[:, None]).sum()),
        predicted=nxt.numel(),
    )


def compare_models(
    ref: ModelFile,
    test: ModelFile,
    prompts: Sequence[tuple[str, list[int]]],
    progress: Callable[[Quality], None] | None = None,
) -> tuple[list[Quality], Quality]:
    """(per-prompt figures, overall figures) of `test` against `ref`."""
    if ref.args != test.args:
        raise DwarfStarError(f"{ref.path} and {test.path} are not the same model (their configurations differ)")
    ref_model, test_model = ReferenceModel(ref), ReferenceModel(test)
    per_prompt, total = [], _Totals()
    for pid, tokens in prompts:
        if len(tokens) < 2:
            raise DwarfStarError(f"prompt {pid!r} has {len(tokens)} token(s); at least 2 are needed")
        ids = torch.tensor(tokens)
        totals = _compare(
            ref_model.forward(ids, ref_model.new_state()), test_model.forward(ids, test_model.new_state()), ids
        )
        total.add(totals)
        per_prompt.append(totals.quality(pid))
        if progress:
            progress(per_prompt[-1])
    return per_prompt, total.quality("overall")
