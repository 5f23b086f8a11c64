"""Token sampling with ds4's knobs and order: temperature, min-p, top-k, top-p, then a seeded draw.

The rules, for one row of logits l with temperature T > 0: each token weighs p_i = exp((l_i - l_max) / T)
(the top token weighs 1); keep the tokens with p_i >= min_p, then the k best of those (k capped at
TOP_K_CAP; 0: all), then, with top-p, each token while the mass of the better kept tokens is below
top_p of the kept total; draw among the survivors in proportion to p_i. Ranking is by logit, ties to
the lower token id (when top-k bounds every row of a batch only its best are ranked, by `torch.topk`,
which leaves the order of exactly equal logits to the device). T <= 0 is greedy: the argmax, ties to
the lower id.

`sample_batch` applies them to a batch of rows on the logits' own device with one host sync (the final
`.tolist()`). Ids a request refuses (`SamplingParams.refused`: the server's control tokens that have
no place in an answer) are never drawn: `redraw_refused` draws again without them, whichever backend
made the draw.

The draw is inverse-CDF with one uniform per row from a counter-based generator, Philox4x32-10 keyed
by the seed at counter `step`, computed on the host (it does not depend on the logits) and
bit-identical to Triton's `tl.rand(seed, step)`. Where top-k or top-p needs a ranking the CDF runs in
rank order, as the Triton backend's kernel (`kernels/sampling.py`) draws, so the two agree where both
apply; with neither, in token-id order, which needs no sort of the vocabulary. Either way a seed gives
the same tokens on every device.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError

TOP_K_CAP = 1024  # ds4 caps top_k; larger values sort the whole vocabulary for nothing
SEED_BITS = 0x7FFFFFFF  # the draw key: the Triton kernel takes the seed as an int32 argument
REDRAW_KEY = 0x5BD1E995  # xored into the key for a refused token's second draw

_MASK32 = 0xFFFFFFFF
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)  # Philox4x32 multipliers
_PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)  # Weyl sequence added to the key after each round
_PHILOX_ROUNDS = 10
_U32_TO_UNIT = np.float32(4.6566127342e-10)  # the largest scale with (2**31 - 1) * scale < 1 in fp32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # <= 0 is greedy
    top_k: int = 0  # 0: no cap
    top_p: float = 1.0
    min_p: float = 0.05  # keep tokens with p >= min_p * p_max (after temperature)
    seed: int | None = None  # None: a fresh random seed
    refused: frozenset[int] = frozenset()  # ids never drawn: a draw of one is redrawn without them

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

    @property
    def ranks(self) -> bool:
        """Whether the rules need the tokens in rank order (top-k or top-p); min-p alone does not."""
        return self.top_k > 0 or self.top_p < 1

    @property
    def candidates(self) -> int | None:
        """How many of the best tokens the rules can keep at most, None when top-k leaves it unbounded."""
        return min(self.top_k, TOP_K_CAP) if self.top_k > 0 else None


GREEDY = SamplingParams(temperature=0.0)


def philox_uniform(seed: int, counter: int) -> float:
    """Triton's `tl.rand(seed, counter)` for a seed below 2**31: Philox4x32-10, first word, as fp32 in [0, 1)."""
    c0, c1, c2, c3 = counter & _MASK32, 0, 0, 0
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(_PHILOX_ROUNDS):
        p0, p2 = _PHILOX_ROUND[0] * c0, _PHILOX_ROUND[1] * c2
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + _PHILOX_KEY_STEP[0]) & _MASK32, (k1 + _PHILOX_KEY_STEP[1]) & _MASK32
    signed = c0 - (1 << 32) if c0 >> 31 else c0
    folded = ~signed if signed < 0 else signed  # the sign bit folded away: 31 random bits
    return float(np.float32(folded) * _U32_TO_UNIT)


class Sampler:
    """One request's sampling: its params and its draw counter (the RNG state is just (seed, step))."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed & SEED_BITS
        self.step = 0  # draws made so far; the next one uses this counter

    def advance(self) -> int:
        """The counter of this draw; the next draw gets the following one."""
        self.step += 1
        return self.step - 1

    def withdraw(self) -> None:
        """Take back the last draw, whose token was never used: the next draw reuses its counter, so
        drawing ahead (a decode step that samples its successor) never shifts a seed's tokens."""
        self.step -= 1

    def __call__(self, logits: torch.Tensor) -> int:
        return sample_batch(logits.reshape(1, -1), [self])[0]


def sample_tokens(logits: torch.Tensor, samplers: Sequence[Sampler]) -> torch.Tensor:
    """Token ids int64 [B] on the logits' device for logits [B, vocab], one row per sampler; no host sync.

    Advances every sampler by one draw.
    """
    rows = logits.float().reshape(len(samplers), -1)
    uniforms = [philox_uniform(s.seed, s.advance()) for s in samplers]
    tokens = list(rows.argmax(-1).split(1))  # greedy: the first maximum, ties to the lower id
    drawn = [i for i, s in enumerate(samplers) if not s.params.greedy]
    for ranked, draw in ((True, _draw_ranked), (False, _draw_by_id)):
        group = [i for i in drawn if samplers[i].params.ranks == ranked]
        if group:
            # rows gathered by Python indices: an index tensor would be a host-to-device copy
            picked = draw(
                torch.stack([rows[i] for i in group]), [samplers[i].params for i in group], [uniforms[i] for i in group]
            )
            for i, token in zip(group, picked.split(1), strict=True):
                tokens[i] = token
    return torch.cat(tokens)


def _draw_ranked(rows: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Token ids [R] for rows with top-k or top-p: the rules applied in rank order."""
    vocab = rows.shape[1]
    bounds = [p.candidates for p in params]
    width = vocab if None in bounds else min(max(bounds), vocab)
    temperature, min_p, top_k, top_p, uniform = _knobs(
        rows.device,
        [p.temperature for p in params],
        [p.min_p for p in params],
        [float(p.candidates or vocab) for p in params],
        [p.top_p for p in params],
        uniforms,
    )
    if width < vocab:  # top-k bounds every row: rank only the best `width`
        values, order = rows.topk(width)
    else:
        # a stable descending sort ranks equal logits by id; tokens below min-p sink to the end as
        # -inf (never kept either way), which makes the sort cheaper
        weight = ((rows - rows.amax(-1, keepdim=True)) / temperature).exp()
        values, order = torch.where(weight >= min_p, rows, -torch.inf).sort(dim=-1, descending=True, stable=True)
    weight = ((values - values[:, :1]) / temperature).exp()
    rank = torch.arange(width, device=rows.device)
    kept = torch.where((weight >= min_p) & (rank < top_k), weight, 0.0)
    mass_before = torch.nn.functional.pad(kept.cumsum(-1)[:, :-1], (1, 0))  # of the better kept tokens
    kept = torch.where(mass_before < top_p * kept.sum(-1, keepdim=True), kept, 0.0)
    return order.gather(1, _draw(kept, uniform)).squeeze(1)


def _draw_by_id(rows: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Token ids [R] for rows with min-p only: which tokens survive needs no ranking."""
    temperature, min_p, uniform = _knobs(
        rows.device, [p.temperature for p in params], [p.min_p for p in params], uniforms
    )
    weight = ((rows - rows.amax(-1, keepdim=True)) / temperature).exp()
    return _draw(torch.where(weight >= min_p, weight, 0.0), uniform).squeeze(1)


def _draw(kept: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Positions [R, 1] drawn in proportion to `kept` (zero: filtered out) by uniforms [R, 1] in [0, 1).

    Position j owns [start_j, start_j + kept_j) of the row's mass, so the drawn one is the last kept
    position starting at or below the target (also when rounding puts the target at the total).
    """
    starts = torch.nn.functional.pad(kept.cumsum(-1)[:, :-1], (1, 0))
    target = uniform * kept.sum(-1, keepdim=True)
    position = torch.arange(kept.shape[1], device=kept.device)
    return torch.where((kept > 0) & (starts <= target), position, -1).amax(-1, keepdim=True)


def redraw_refused(rows: Sequence[torch.Tensor], samplers: Sequence[Sampler], drawn: list[int]) -> list[int]:
    """`drawn` (one token per sampler, each sampler advanced by its draw) with every token its sampler
    refuses replaced by a second draw from its row of logits without the refused ids, the rules applied
    again over the rest. The second draw's uniform comes from the seed xor REDRAW_KEY at the same
    counter: independent of the first (whose uniform fell in a refused token's interval), and the
    sampler's counter still moves by one a token, so a seed's later tokens do not shift. A token t
    is thus drawn with probability P(t) + P(refused) * P'(t), P the rules' distribution over the
    whole row and P' over the allowed ids. Any backend's draw (a captured step's included) is checked
    on the host after its one sync; a redraw, rare, costs a second one."""
    flagged = [
        i for i, (sampler, token) in enumerate(zip(samplers, drawn, strict=True)) if token in sampler.params.refused
    ]
    if not flagged:
        return drawn
    masked, twins = [], []
    for i in flagged:
        twin = copy.copy(samplers[i])
        twin.seed, twin.step = (twin.seed ^ REDRAW_KEY) & SEED_BITS, twin.step - 1
        twins.append(twin)
        row = rows[i].reshape(-1).float().clone()
        row[torch.tensor(sorted(twin.params.refused), device=row.device)] = -torch.inf
        masked.append(row)
    redrawn = sample_tokens(torch.stack(masked), twins).tolist()
    tokens = list(drawn)
    for i, token in zip(flagged, redrawn, strict=True):
        tokens[i] = token
    return tokens


def sample_batch(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """One token per row of logits [B, vocab] (any device) by each row's sampler; one host sync."""
    if logits.shape[0] != len(samplers):
        raise DwarfStarError(f"{logits.shape[0]} rows of logits for {len(samplers)} samplers")
    return sample_tokens(logits, samplers).tolist()


def _knobs(device: torch.device, *columns: list[float]) -> tuple[torch.Tensor, ...]:
    """Per-row values as float32 [R, 1] tensors on `device`, in one copy queued behind the work in flight."""
    host = torch.tensor(columns, dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()  # a copy from pageable memory would make the host wait for the stream
    return host.to(device, non_blocking=True)[:, :, None].unbind(0)
