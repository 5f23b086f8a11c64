"""A direction applied inside any backend, through the forward pass's `attn_out` / `ffn_out` hooks.

The direction's rows live in the backend's own array type on its device, converted once at load;
the hooks only multiply, so no layer makes a host round trip, and the CPU and GPU run the same
code. `SteeredBackend` wraps the backend the engine hands out: before each forward call it writes
the scale of every row of the call (each sequence's own, the server's per-request scales) into a
per-row array that the hooks read. On torch that array is one persistent buffer written in place
for any call of up to `ROW_CAPACITY` rows, so a decode step the Triton backend replays from a
captured CUDA graph (which baked in the buffer's address and took the same code path) reads the
current scales; a longer call, which is a prefill chunk and runs eagerly, gets its own array.

Per-sequence settings belong to sessions (`assign`): a session's state is replaced when it is cut
back or restored, but the session stays, so the setting follows it.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.backends.protocol import Backend
from dwarfstar.backends.registry import entry_of
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.forward import Batch, HookPoint, Transformer, forward_then_sample
from dwarfstar.model.forward_v41 import Transformer41
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.model_v41 import Model41
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler
from dwarfstar.session.session import Session
from dwarfstar.steering.direction import Direction, SteeringError, SteeringScale, read_direction, steer

POINTS: tuple[HookPoint, ...] = ("ffn_out", "attn_out")
# rows of the persistent scale buffer: more than any batched decode step has sequences
ROW_CAPACITY = 1024


def hookable(backend: Backend) -> Transformer | Transformer41:
    """The forward pass a backend's hooks go on: every V4 backend is one, a V4.1 model holds one (a route
    has none)."""
    if isinstance(backend, Model41):
        return backend.transformer
    if not isinstance(backend, Transformer):
        raise TypeError(f"{type(backend).__name__} has no Transformer to hook")
    return backend


class DeviceArrays:
    """Making the backend's arrays from host values: torch tensors on the model's device, or MLX arrays
    (a V4.1 forward's: whichever its ops make)."""

    def __init__(self, model: Transformer | Transformer41) -> None:
        if isinstance(model, Transformer41):
            probe = model.ops.first_pre(1)
            self.mlx = not isinstance(probe, torch.Tensor)
            self.device = probe.device if isinstance(probe, torch.Tensor) else torch.device("cpu")
            return
        entry = entry_of(model)
        self.mlx = entry is not None and entry.mlx_arrays
        self.device = getattr(model, "device", torch.device("cpu"))

    def from_host(self, values: np.ndarray | torch.Tensor) -> Any:
        if self.mlx:
            import mlx.core as mx

            return mx.array(np.asarray(values, dtype=np.float32))
        return torch.as_tensor(values, dtype=torch.float32).to(self.device)

    def to_host(self, x: Any) -> torch.Tensor:
        return torch.from_numpy(np.array(x, dtype=np.float32)) if self.mlx else x.detach().float().cpu()


class Steering:
    """The hooks of one direction on one forward pass, and the scales they read."""

    def __init__(self, model: Transformer | Transformer41, direction: Direction, default: SteeringScale) -> None:
        n_layers, hidden = model.args.n_layers, model.args.dim
        if direction.shape != (n_layers, hidden):
            raise ValueError(f"direction {direction.shape} for a model of [{n_layers}, {hidden}]")
        self.direction, self.default, self.arrays = direction, default, DeviceArrays(model)
        vectors = self.arrays.from_host(direction.vectors)
        self.rows = [vectors[il] for il in range(n_layers)]  # views (lazy slices in MLX), made once
        self._buffers = {point: self.arrays.from_host(np.zeros(ROW_CAPACITY, np.float32)) for point in POINTS}
        self._current: dict[HookPoint, Any] = dict(self._buffers)
        self.stage([default], [ROW_CAPACITY])  # a call that bypasses `SteeredBackend` gets the default
        self.model = model
        self._hooks = {point: self._hook(point) for point in POINTS}
        for point, hook in self._hooks.items():
            model.hooks[point].insert(0, hook)  # first: other hooks see the steered output

    def detach(self) -> None:
        """Take the hooks off the forward pass: it runs unsteered again."""
        for point, hook in self._hooks.items():
            self.model.hooks[point].remove(hook)

    def _hook(self, point: HookPoint):
        def apply(il: int, out: Any, batch: Batch | None = None) -> Any:  # a V4.1 forward passes no batch
            return steer(out, self.rows[il], self._current[point][: out.shape[0]])

        return apply

    def stage(self, scales: Sequence[SteeringScale], lengths: Sequence[int]) -> None:
        """The scales of the next call, whose sequences add `lengths` rows each."""
        n_rows = sum(lengths)
        for point in POINTS:
            values = [s.at(point) for s in scales]
            if self.arrays.mlx or n_rows > ROW_CAPACITY:
                self._current[point] = self.arrays.from_host(np.repeat(np.array(values, np.float32), lengths))
                continue
            buffer = self._current[point] = self._buffers[point]
            if len(set(values)) == 1:
                buffer[:n_rows].fill_(values[0])  # a kernel, no host-to-device copy
            else:
                buffer[:n_rows].copy_(torch.from_numpy(np.repeat(np.array(values, np.float32), lengths)))


class SteeredBackend:
    """A backend whose forward calls apply a steering direction; everything else is the backend's own."""

    def __init__(self, backend: Backend, direction: Direction, default: SteeringScale) -> None:
        self.inner = backend
        self.args = backend.args
        self.model = hookable(backend)
        self.steering = Steering(self.model, direction, default)
        # a V4.1 model runs its sequences (and a call of all logits, its tokens) a call at a time, each
        # reading the scale buffer from its first row: each sequence's scale is staged before its own call
        self.per_sequence = isinstance(self.model, Transformer41)
        self._sessions: weakref.WeakKeyDictionary[Session, SteeringScale] = weakref.WeakKeyDictionary()

    @property
    def default(self) -> SteeringScale:
        return self.steering.default

    def detach(self) -> Backend:
        """The backend without steering (its hooks removed)."""
        self.steering.detach()
        return self.inner

    def assign(self, session: Session, scale: SteeringScale) -> None:
        """`session`'s sequence is steered at `scale` from its next forward call on."""
        self._sessions[session] = scale

    def scale_of(self, state: SequenceState) -> SteeringScale:
        for session, scale in self._sessions.items():
            if session.state is state:
                return scale
        return self.default

    def _stage(self, token_lists: Sequence[Sequence[int] | torch.Tensor], states: Sequence[SequenceState]) -> None:
        # the forward pass skips sequences given no tokens, so they take no rows here either
        pairs = [(self.scale_of(s), len(t)) for t, s in zip(token_lists, states, strict=True) if len(t)]
        self.steering.stage([p[0] for p in pairs], [p[1] for p in pairs])

    def forward(
        self,
        tokens: Sequence[int] | torch.Tensor,
        state: SequenceState,
        all_logits: bool = True,
        images: Sequence[ImageSpan] | None = None,
    ) -> torch.Tensor:
        self._stage([tokens], [state])
        return self.inner.forward(tokens, state, all_logits, images=images)

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits=False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        if self.per_sequence:
            spans = [None] * len(states) if images is None else list(images)
            for t, s, i in zip(token_lists, states, spans, strict=True):
                self.inner.check_call(t, s, i)  # all checked before any runs, as the model does
            return [self.forward(t, s, all_logits, i) for t, s, i in zip(token_lists, states, spans, strict=True)]
        self._stage(token_lists, states)
        return self.inner.forward_batch(token_lists, states, all_logits, images=images)

    def decode_sample(
        self, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence[Sampler]
    ) -> list[int]:
        if self.per_sequence:
            return forward_then_sample(self, tokens, states, samplers)
        self._stage([[t] for t in tokens], states)
        return self.inner.decode_sample(tokens, states, samplers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def steering_of(backend: Any) -> SteeredBackend | None:
    """The steering layer of an engine's backend, through a throttle wrapper; None when unsteered."""
    while backend is not None:
        if isinstance(backend, SteeredBackend):
            return backend
        backend = getattr(backend, "__dict__", {}).get("inner")  # not through a wrapper's __getattr__
    return None


class SteeringOptions:
    """`--dir-steering-file/-ffn/-attn` as given: the file is read once the model's shape is known."""

    def __init__(self, path: Path, ffn: float | None = None, attn: float | None = None) -> None:
        # ds4's defaults: a given file steers the FFN fully and leaves attention alone
        self.path = Path(path)
        self.scale = SteeringScale(1.0 if ffn is None else ffn, 0.0 if attn is None else attn)

    def flags(self) -> list[str]:
        """The same options as `dwarfstar` flags (for a server started as a child process)."""
        return [
            "--dir-steering-file", str(self.path),
            "--dir-steering-ffn", repr(self.scale.ffn),
            "--dir-steering-attn", repr(self.scale.attn),
        ]  # fmt: skip

    def tag(self) -> str:
        """The setting as saved state records it: the direction's content hash and both scales."""
        try:
            digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        except OSError as exc:
            raise SteeringError(f"cannot read {self.path}: {exc.strerror}") from None
        return f"direction {digest} ffn {self.scale.ffn:g} attn {self.scale.attn:g}"

    def read(self, args: ModelArgs | ModelArgs41) -> Direction:
        return read_direction(self.path, args.n_layers, args.dim)

    def install(self, backend: Backend, direction: Direction) -> SteeredBackend:
        return SteeredBackend(backend, direction, self.scale)
