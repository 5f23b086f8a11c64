"""Token sampling with ds4's knobs and order: temperature, min-p, top-k, top-p, then a seeded draw."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from dwarfstar.errors import DwarfStarError

TOP_K_CAP = 1024  # ds4 caps top_k; larger values sort the whole vocabulary for nothing


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # <= 0 is greedy
    top_k: int = 0  # 0: no cap
    top_p: float = 1.0
    min_p: float = 0.05  # keep tokens with p >= min_p * p_max (after temperature)
    seed: int | None = None  # None: a fresh random seed

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise DwarfStarError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DwarfStarError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise DwarfStarError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise DwarfStarError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits.float().flatten()
        if p.greedy:
            return int(logits.argmax())
        # min-p keeps tokens with exp((l - max) / T) >= min_p, i.e. l >= max + T ln(min_p): filtering by
        # that threshold first leaves a handful of candidates, so nothing sorts the whole vocabulary
        ids = torch.arange(logits.numel())
        if p.min_p > 0:
            ids = (logits >= logits.max() + p.temperature * math.log(p.min_p)).nonzero().flatten()
        values = logits[ids]
        k = min(p.top_k, TOP_K_CAP) if p.top_k > 0 else values.numel()
        values, order = values.topk(min(k, values.numel()))  # sorted, descending
        ids = ids[order]
        probs = ((values - values[0]) / p.temperature).exp()
        if p.top_p < 1.0:
            total = probs.sum()
            before = probs.cumsum(0) - probs  # mass of the better candidates
            probs = probs * (before < p.top_p * total)  # keep up to the token that crosses top_p
        choice = torch.multinomial(probs / probs.sum(), 1, generator=self.generator)
        return int(ids[choice])
