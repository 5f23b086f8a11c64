"""`--power N`: keep the device about N% busy by sleeping in proportion to the work just done.

After each unit of work that took `t` seconds the throttle owes `t * (100 - N) / N` seconds of idle
time. Every forward call is a unit (a prefill chunk, or one decoded token), and so is each block of
the shared forward pass (`Transformer.block`), so prefill pauses between layers as ds4 does, and the
forward call then owes only for the rest (embedding, output head). Debts under a millisecond are
carried over rather than slept, because a tiny model's layers take microseconds and `time.sleep`
cannot wait that little accurately.

Sleeping never touches the numbers, so the output is the same at any setting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dwarfstar.backends.protocol import Backend
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.forward import Transformer
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler

MIN_SLEEP_S = 0.001


class DutyCycle:
    def __init__(self, percent: int) -> None:
        if not 1 <= percent <= 100:
            raise DwarfStarError(f"--power must be between 1 and 100, got {percent}")
        self.idle_per_busy = (100 - percent) / percent
        self.owed_s = 0.0
        self.slept_s = 0.0
        self.busy_s = 0.0

    def timed(self, work: Callable[..., Any]) -> Callable[..., Any]:
        """`work` wrapped so that every call is followed by its share of idle time; busy time of timed
        calls nested inside it is paid for once, by them."""

        def run(*args: Any, **kwargs: Any) -> Any:
            start, slept, busy = time.perf_counter(), self.slept_s, self.busy_s
            out = work(*args, **kwargs)
            if any(isinstance(o, torch.Tensor) and o.is_cuda for o in (out if isinstance(out, list) else [out])):
                torch.cuda.synchronize()  # GPU work is asynchronous: wait for it, or busy time reads as ~0
            nested = (self.slept_s - slept) + (self.busy_s - busy)
            self._owe(time.perf_counter() - start - nested)
            return out

        return run

    def _owe(self, busy_s: float) -> None:
        self.busy_s += busy_s
        self.owed_s += busy_s * self.idle_per_busy
        if self.owed_s >= MIN_SLEEP_S:
            start = time.perf_counter()
            time.sleep(self.owed_s)
            slept = time.perf_counter() - start
            self.slept_s += slept
            self.owed_s -= slept  # oversleeping is paid back by the next units


class ThrottledBackend:
    """A backend whose forward calls, and the blocks of its forward pass, are paced by a `DutyCycle`.

    Everything else (batched forward, device sampling, the context, state helpers) is the backend's own.
    """

    def __init__(self, backend: Backend, duty: DutyCycle) -> None:
        self.inner, self.duty = backend, duty
        self.args: ModelArgs = backend.args
        if isinstance(backend, Transformer):  # every backend's own forward pass (one shape)
            # the CLI owns this backend for the whole process, so pacing its layers in place is safe
            backend.block = duty.timed(backend.block)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: SequenceState,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> torch.Tensor:
        return self.duty.timed(self.inner.forward)(tokens, state, all_logits, images=images)

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits=False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        return self.duty.timed(self.inner.forward_batch)(token_lists, states, all_logits, images=images)

    def decode_sample(
        self, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence[Sampler]
    ) -> list[int]:
        return self.duty.timed(self.inner.decode_sample)(tokens, states, samplers)


def throttle(backend: Backend, percent: int) -> Backend:
    """The backend paced to `percent` busy time; the backend itself at 100."""
    duty = DutyCycle(percent)
    return backend if percent == 100 else ThrottledBackend(backend, duty)
