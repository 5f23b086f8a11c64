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

Logprobs (`SamplingParams.logprobs`: how many alternatives to report, None for none). A draw of a
sampler that asks records its token's log-probability and its `logprobs` best alternatives in
`Sampler.logprobs` (`TokenLogprobs`). They are the model's: log-softmax of logits / T, after the
temperature but before min-p, top-k and top-p, so they describe the distribution the model gave and
not the truncated one the token was drawn from (a token those rules cut still has its logprob). A
greedy request reports them at temperature 1. `logprob_rows` computes them on the device with the
draw (a log-sum-exp, a gather and a top-k of the rows that ask), and the draw's one host sync reads
them with the tokens (`read_draws`); a redrawn token's (a refused token's, or one the Triton kernel
flags) is read again with its redraw.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    logprobs: int | None = None  # alternatives reported with each drawn token's logprob; None: no logprobs

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= 100:
            raise DwarfStarError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DwarfStarError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise DwarfStarError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise DwarfStarError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise DwarfStarError(f"logprobs must be >= 0, got {self.logprobs}")

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

    @property
    def logprob_temperature(self) -> float:
        """The temperature logprobs are reported at: the request's, 1 for a greedy one."""
        return 1.0 if self.greedy else self.temperature


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


@dataclass(frozen=True)
class Alternative:
    token: int
    logit: float
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's logprob and the best alternatives (best first), at `temperature`: logprob =
    logit / temperature - lse, lse the log-sum-exp of the row's logits / temperature."""

    token: int
    logit: float
    logprob: float
    top: tuple[Alternative, ...]
    lse: float
    temperature: float

    def of(self, token: int, logit: float) -> TokenLogprobs:
        """The same step's figures for another drawn token (a redraw) whose logit is `logit`."""
        return replace(self, token=token, logit=logit, logprob=_logprob(logit, self.temperature, self.lse))


def _logprob(logit: float, temperature: float, lse: float) -> float:
    # at most 0: rounding in the float32 log-sum-exp may put the best token a hair above it
    return min(0.0, logit / temperature - lse)


class Sampler:
    """One request's sampling: its params and its draw counter (the RNG state is just (seed, step))."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.seed = seed & SEED_BITS
        self.step = 0  # draws made so far; the next one uses this counter
        self.logprobs: TokenLogprobs | None = None  # the last draw's, when the params ask for them

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
        relabel_logprobs(samplers[i], rows[i], token)
    return tokens


def sample_batch(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """One token per row of logits [B, vocab] (any device) by each row's sampler, with the logprobs of
    the rows that ask; one host sync."""
    if logits.shape[0] != len(samplers):
        raise DwarfStarError(f"{logits.shape[0]} rows of logits for {len(samplers)} samplers")
    tokens = sample_tokens(logits, samplers)
    return read_draws(tokens, logits, tokens, samplers)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, samplers: Sequence[Sampler]) -> torch.Tensor | None:
    """What the samplers that ask for logprobs need of a draw, on the logits' device without a host
    sync: float32 [R, 3 + 2k], one row per such sampler (in order): its drawn token, that token's logit,
    the log-sum-exp of the row's logits / T, the k best logits and their ids (k: the most any of them
    asks; ids are exact in float32 below 2**24). `logits` [B, vocab], `tokens` [B] the drawn ids; None
    when no sampler asks."""
    asking = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    if not asking:
        return None
    rows, drawn = logits.reshape(len(samplers), -1), tokens.reshape(-1)
    if len(asking) < len(samplers):  # by Python indices: an index tensor would be a host-to-device copy
        rows, drawn = torch.stack([rows[i] for i in asking]), torch.stack([drawn[i] for i in asking])
    rows, chosen = rows.float(), drawn.long()[:, None]
    (temperature,) = _knobs(rows.device, [samplers[i].params.logprob_temperature for i in asking])
    best, ids = rows.topk(min(max(samplers[i].params.logprobs for i in asking), rows.shape[1]))
    lse = (rows / temperature).logsumexp(-1, keepdim=True)
    return torch.cat([chosen.float(), rows.gather(1, chosen), lse, best, ids.float()], dim=1)


def record_logprobs(samplers: Sequence[Sampler], packed: Sequence[float]) -> None:
    """Each asking sampler's `logprobs`, from the host copy of `logprob_rows`' result (flattened)."""
    asking = [s for s in samplers if s.params.logprobs is not None]
    width = len(packed) // len(asking)
    k = (width - 3) // 2
    for n, sampler in enumerate(asking):
        row = packed[n * width : (n + 1) * width]
        t, lse = sampler.params.logprob_temperature, row[2]
        top = tuple(
            Alternative(int(row[3 + k + m]), row[3 + m], _logprob(row[3 + m], t, lse))
            for m in range(min(sampler.params.logprobs, k))
        )
        sampler.logprobs = TokenLogprobs(int(row[0]), row[1], _logprob(row[1], t, lse), top, lse, t)


def read_draws(
    ints: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor, samplers: Sequence[Sampler]
) -> list[int]:
    """`ints.tolist()` (a draw's results: its tokens, maybe flags), with the logprobs of the drawn
    `tokens` [B] from `logits` [B, vocab] read in the same host sync and recorded in the samplers
    that ask for them."""
    packed = logprob_rows(logits, tokens, samplers)
    if packed is None:
        return ints.tolist()
    n = ints.numel()
    host = torch.cat([ints.reshape(-1).float(), packed.reshape(-1)]).tolist()  # ids and flags exact in float32
    record_logprobs(samplers, host[n:])
    return [int(v) for v in host[:n]]


def relabel_logprobs(sampler: Sampler, row: torch.Tensor, token: int) -> None:
    """After a redraw of the sampler's last draw from `row`: its logprobs for the token it now drew
    (one read of the row, on top of the redraw's own sync)."""
    if sampler.logprobs is not None and sampler.logprobs.token != token:
        sampler.logprobs = sampler.logprobs.of(token, float(row.reshape(-1)[token]))


def _knobs(device: torch.device, *columns: list[float]) -> tuple[torch.Tensor, ...]:
    """Per-row values as float32 [R, 1] tensors on `device`, in one copy queued behind the work in flight."""
    host = torch.tensor(columns, dtype=torch.float32)
    if device.type == "cuda":
        host = host.pin_memory()  # a copy from pageable memory would make the host wait for the stream
    return host.to(device, non_blocking=True)[:, :, None].unbind(0)
