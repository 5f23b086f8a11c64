"""The MLX backend's KV-cache arrays: `MLXStorage`, the `model.state.Storage` of MLX arrays.

The cache, its slots and the state handles are the backend-neutral `model.state` ones; only the
arrays are MLX's. MLX arrays are values: a slice taken before an assignment into its array keeps
the old contents, so a snapshot's copy is a plain slice, and an assignment into a block (`a[i, lo:hi]
= v`) is done in place when nothing else holds the old buffer. The forward pass leaves the writes
lazy; `lazy_arrays` lists what a call updated, to evaluate together with its logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from dwarfstar.model.state import SequenceState


@dataclass(frozen=True)
class MLXStorage:
    element_size: int = 4  # float32: the payload's precision, which the MLX ops compute in
    device: str = "cpu"  # where the logits go: torch on the host (unified memory on Apple)

    def full(self, shape: tuple[int, ...], value: float | None) -> mx.array:
        return mx.zeros(shape) if value is None else mx.full(shape, value)

    def rows(self, shape: tuple[int, ...], exact_dims: int) -> mx.array:
        return self.full(shape, None)  # float32 throughout: the MLX ops compute in it

    def row_nbytes(self, dim: int, exact_dims: int) -> int:
        return dim * self.element_size

    def table(self, shape: tuple[int, ...]) -> np.ndarray:
        # the MLX ops gather rows by host indices (`take_rows`): no kernel reads a table here
        return np.zeros(shape, dtype=np.int32)

    def take_rows(self, pool: mx.array, pages: np.ndarray, offsets: np.ndarray) -> mx.array:
        return pool[mx.array(pages), mx.array(offsets)]

    def put_rows(self, pool: mx.array, pages: np.ndarray, offsets: np.ndarray, value: mx.array) -> None:
        pool[mx.array(pages), mx.array(offsets)] = value

    def copy(self, a: mx.array) -> mx.array:
        return mx.array(a)

    def cat(self, parts: Sequence[mx.array]) -> mx.array:
        return mx.concatenate(list(parts))

    def to_numpy(self, a: mx.array) -> np.ndarray:
        return np.array(a, dtype=np.float32)

    def from_numpy(self, a: np.ndarray) -> mx.array:
        return mx.array(np.asarray(a, dtype=np.float32))


def lazy_arrays(state: SequenceState) -> list[mx.array]:
    """The cache arrays of the state's block, which a forward pass may have left lazy."""
    return [a for il in state.cache.layers for a in state.parts(il).values()]
