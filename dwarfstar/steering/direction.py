"""Steering directions: ds4's file, its sidecar, and the direction math (build and apply).

The file is ds4's: raw little-endian float32 `[n_layers][hidden]`, nothing else, so its size alone
says whether it fits a model (Flash: 43 x 4096 x 4 = 704,512 bytes; PRO: 61 x 7168 x 4). The
sidecar `<file>.json` carries `"format": "ds4-directional-steering-v1"`, the shape, the component
(`ffn_out` or `attn_out`) and the build settings; a file without one is read with the defaults
(component `ffn_out`), as ds4 reads it.

Applying a direction v at scale F replaces a sublayer's hidden-wide output y by y - F v (v . y):
F = 1 removes the component along v, F < 0 amplifies it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError

FORMAT = "ds4-directional-steering-v1"
COMPONENTS = ("ffn_out", "attn_out")
DEFAULT_COMPONENT = "ffn_out"
KNOWN_SHAPES = {"DeepSeek V4 Flash": (43, 4096), "DeepSeek V4 PRO": (61, 7168)}  # [n_layers, hidden]
MAX_SCALE = 100.0  # ds4's range for --dir-steering-ffn / --dir-steering-attn
# a mean difference this small has no direction worth normalising (fp32 noise of equal means)
MIN_NORM = 1e-12


class SteeringError(DwarfStarError):
    """A steering file, its sidecar, or a steering scale is unusable."""


def check_scale(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or abs(value) > MAX_SCALE:
        raise SteeringError(f"{name} must be a number between -{MAX_SCALE:g} and {MAX_SCALE:g}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SteeringScale:
    """How strongly each hook point removes the direction; (0, 0) is no steering at all."""

    ffn: float = 0.0
    attn: float = 0.0

    def __post_init__(self) -> None:
        # + 0.0 folds -0.0 into 0.0, so equal settings compare (and key a cache) equal
        object.__setattr__(self, "ffn", check_scale("the FFN steering scale", self.ffn) + 0.0)
        object.__setattr__(self, "attn", check_scale("the attention steering scale", self.attn) + 0.0)

    @property
    def off(self) -> bool:
        return self.ffn == 0.0 and self.attn == 0.0

    def at(self, point: str) -> float:
        return self.ffn if point == "ffn_out" else self.attn


@dataclass(frozen=True)
class Direction:
    vectors: torch.Tensor  # float32 [n_layers, hidden] on the CPU, as the file holds them
    component: str = DEFAULT_COMPONENT  # the hook point it was built from
    settings: dict[str, Any] = field(default_factory=dict)  # the sidecar's build settings
    digest: str = ""  # sha256 of the file's bytes: which direction a cached state was steered by

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.vectors.shape)  # type: ignore[return-value]


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def write_direction(path: Path, vectors: torch.Tensor, component: str, settings: dict[str, Any]) -> None:
    """The f32 file and its sidecar."""
    if component not in COMPONENTS:
        raise SteeringError(f"component must be one of {', '.join(COMPONENTS)}, got {component!r}")
    values = vectors.detach().cpu().to(torch.float32).numpy().astype("<f4", copy=False)
    n_layers, hidden = values.shape
    path.write_bytes(values.tobytes())
    sidecar = {"format": FORMAT, "shape": [n_layers, hidden], "component": component, **settings}
    sidecar_path(path).write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")


def read_direction(path: Path, n_layers: int, hidden: int) -> Direction:
    """The direction for a model of `n_layers` x `hidden`: a size that does not fit is an error naming both."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SteeringError(f"cannot read steering file {path}: {exc.strerror or exc}") from None
    want = n_layers * hidden * 4
    if len(raw) != want:
        raise SteeringError(
            f"steering file {path} has {len(raw)} bytes ({_file_shape(Path(path), len(raw), hidden)}); "
            f"this model needs [{n_layers}, {hidden}] float32 = {want} bytes"
        )
    values = np.frombuffer(raw, dtype="<f4").reshape(n_layers, hidden)
    if not np.isfinite(values).all():
        bad = np.argwhere(~np.isfinite(values))[0]
        where = f"first at layer {bad[0]}, dim {bad[1]}"
        raise SteeringError(f"steering file {path} holds NaN or infinite values ({where})")
    component, settings = _read_sidecar(Path(path), n_layers, hidden)
    vectors = torch.from_numpy(values.astype(np.float32))
    return Direction(vectors, component, settings, hashlib.sha256(raw).hexdigest())


def _file_shape(path: Path, size: int, hidden: int) -> str:
    """What a file of `size` bytes holds: its sidecar's shape, else a known model's, else rows of `hidden`."""
    try:
        shape = json.loads(sidecar_path(path).read_text(encoding="utf-8"))["shape"]
        if isinstance(shape, list) and len(shape) == 2 and shape[0] * shape[1] * 4 == size:
            return f"[{shape[0]}, {shape[1]}] by its sidecar"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for name, (layers, width) in KNOWN_SHAPES.items():
        if layers * width * 4 == size:
            return f"[{layers}, {width}], {name}'s shape"
    if size % 4:
        return "not whole float32 values"
    return f"[{size // (4 * hidden)}, {hidden}]" if size % (4 * hidden) == 0 else f"{size // 4} float32 values"


def _read_sidecar(path: Path, n_layers: int, hidden: int) -> tuple[str, dict[str, Any]]:
    side = sidecar_path(path)
    if not side.exists():
        return DEFAULT_COMPONENT, {}
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SteeringError(f"cannot read steering sidecar {side}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SteeringError(f"steering sidecar {side} is not {FORMAT!r} (format: {meta.get('format')!r})")
    shape = meta.get("shape")
    if shape is not None and list(shape) != [n_layers, hidden]:
        raise SteeringError(f"steering sidecar {side} says shape {shape}; this model needs [{n_layers}, {hidden}]")
    component = meta.get("component", DEFAULT_COMPONENT)
    if component not in COMPONENTS:
        raise SteeringError(f"steering sidecar {side} names component {component!r}; expected one of {COMPONENTS}")
    settings = {k: v for k, v in meta.items() if k not in ("format", "shape", "component")}
    return component, settings


def _unit(x: torch.Tensor) -> torch.Tensor:
    norm = x.norm(dim=-1, keepdim=True)
    return torch.where(norm > MIN_NORM, x / norm.clamp_min(MIN_NORM), torch.zeros_like(x))


def build_direction(good: torch.Tensor, bad: torch.Tensor, remove_bad_projection: bool = True) -> torch.Tensor:
    """Per layer, the unit difference of the means, good minus bad: [n_layers, hidden] from
    activations good [n_good, n_layers, hidden] and bad [n_bad, n_layers, hidden].

    With `remove_bad_projection`, the part along the unit bad mean is taken out and the rest
    renormalised, so removing the direction does not also shrink what every bad prompt shares.
    Computed in float64: the two means can be close, and their difference is what matters.
    """
    if good.ndim != 3 or good.shape[1:] != bad.shape[1:] or not len(good) or not len(bad):
        raise SteeringError(f"good {tuple(good.shape)} and bad {tuple(bad.shape)} activations do not pair up")
    good_mean, bad_mean = good.double().mean(0), bad.double().mean(0)
    direction = _unit(good_mean - bad_mean)
    if remove_bad_projection:
        bad_unit = _unit(bad_mean)
        direction = _unit(direction - bad_unit * (direction * bad_unit).sum(-1, keepdim=True))
    return direction.float()


def projection(y: Any, v: Any) -> Any:
    """v . y per row of y [N, hidden] (torch or MLX arrays): the component steering acts on."""
    return y @ v


def steer(y: Any, v: Any, scale: Any) -> Any:
    """y - F v (v . y) for rows y [N, hidden], unit v [hidden], F a [1] or [N] array of the backend's type."""
    return y - (projection(y, v) * scale)[:, None] * v[None, :]
