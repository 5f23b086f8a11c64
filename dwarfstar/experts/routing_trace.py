"""Recorded routing: which experts each token chose in each layer, call by call.

A trace is the input of the policy simulator and of `dwarfstar bench experts --replay`; its per-expert
counts are the hot-expert profile that seeds the cache (`dwarfstar profile-experts` writes one).
Files are `.npz`: `ids` int16 [n_tokens, n_layers, k], `calls` (tokens per forward call, so a
replay groups a prefill chunk's tokens as the model did) and `n_experts`.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError


class TraceError(DwarfStarError):
    """A routing trace or profile file that cannot be read."""


@dataclass
class RoutingTrace:
    ids: np.ndarray  # int16 [n_tokens, n_layers, k]
    calls: np.ndarray  # int64 [n_calls]: tokens of each forward call, in order
    n_experts: int

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    def steps(self) -> Iterator[np.ndarray]:
        """Each forward call's ids [n, n_layers, k]."""
        start = 0
        for n in self.calls.tolist():
            yield self.ids[start : start + n]
            start += n

    def accesses(self) -> list[int]:
        """Keys (layer * n_experts + expert) in the order a cache sees them: per call, per layer,
        the call's distinct experts ascending (the MoE reads each once per call)."""
        out: list[int] = []
        for step in self.steps():
            for il in range(self.n_layers):
                out.extend((il * self.n_experts + np.unique(step[:, il])).tolist())
        return out

    def counts(self) -> np.ndarray:
        """Uses per key over the whole trace: the hot-expert profile."""
        keys = self.ids.astype(np.int64) + np.arange(self.n_layers)[None, :, None] * self.n_experts
        return np.bincount(keys.reshape(-1), minlength=self.n_layers * self.n_experts)

    def hot_keys(self) -> list[int]:
        counts = self.counts()
        order = np.argsort(-counts, kind="stable")
        return order[counts[order] > 0].tolist()

    def save(self, path: str | os.PathLike) -> None:
        np.savez_compressed(path, ids=self.ids, calls=self.calls, n_experts=np.int64(self.n_experts))

    @classmethod
    def load(cls, path: str | os.PathLike, n_layers: int | None = None, n_experts: int | None = None) -> RoutingTrace:
        """Read a trace; with a model's shape given, also check the trace is of that shape."""
        try:
            with np.load(Path(path)) as data:
                ids, calls, n_exp = data["ids"], data["calls"], int(data["n_experts"])
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise TraceError(f"{path}: not a routing trace ({e})") from None
        if ids.ndim != 3 or calls.sum() != ids.shape[0] or ids.size and not 0 <= ids.min() <= ids.max() < n_exp:
            raise TraceError(f"{path}: inconsistent routing trace (ids {ids.shape}, {calls.sum()} tokens in calls)")
        if n_layers is not None and (ids.shape[1], n_exp) != (n_layers, n_experts):
            raise TraceError(
                f"{path}: a trace of {ids.shape[1]} layers x {n_exp} experts, but the model has "
                f"{n_layers} x {n_experts}"
            )
        return cls(ids.astype(np.int16), calls.astype(np.int64), n_exp)


class TraceRecorder:
    """A reference-model route observer that records each forward call's choices."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        self._calls: list[np.ndarray] = []
        self._layers: list[np.ndarray] = []

    def __call__(self, layer: int, ids: torch.Tensor) -> None:
        if layer == 0:
            self._flush()
        self._layers.append(ids.detach().cpu().numpy().astype(np.int16))

    def _flush(self) -> None:
        if len(self._layers) == self.n_layers:
            self._calls.append(np.stack(self._layers, axis=1))
        self._layers = []

    def trace(self) -> RoutingTrace:
        self._flush()
        if not self._calls:
            raise TraceError("no forward call was recorded")
        calls = np.array([c.shape[0] for c in self._calls], dtype=np.int64)
        return RoutingTrace(np.concatenate(self._calls), calls, self.n_experts)


def skewed_trace(
    n_layers: int,
    n_experts: int,
    k: int,
    n_tokens: int,
    zipf: float,
    drift_every: int = 256,
    drift: float = 0.1,
    seed: int = 0,
) -> RoutingTrace:
    """A decode trace (one token per call) whose per-layer expert popularity falls as rank^-zipf.

    Each layer ranks its experts in its own random order; every `drift_every` tokens a fraction
    `drift` of the ranks swap places, so what is hot changes slowly, as it does across a real
    conversation. Tokens pick k distinct experts with probability proportional to popularity.
    """
    rng = np.random.default_rng(seed)
    weight = 1.0 / np.arange(1, n_experts + 1) ** zipf
    ranks = np.stack([rng.permutation(n_experts) for _ in range(n_layers)])  # [layer, rank] -> expert
    ids = np.empty((n_tokens, n_layers, k), dtype=np.int16)
    for t in range(n_tokens):
        if t and t % drift_every == 0:
            for il in range(n_layers):
                moved = rng.choice(n_experts, size=max(2, int(drift * n_experts)) // 2 * 2, replace=False)
                ranks[il, moved] = ranks[il, np.roll(moved, 1)]
        # Gumbel top-k: k distinct draws proportional to the weights
        keys = np.log(weight)[None, :] - np.log(-np.log(rng.random((n_layers, n_experts))))
        top = np.argsort(-keys, axis=1)[:, :k]
        ids[t] = np.take_along_axis(ranks, top, axis=1)
    return RoutingTrace(ids, np.ones(n_tokens, dtype=np.int64), n_experts)
