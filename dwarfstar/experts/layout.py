"""Where the routed experts are in a GGUF, and how many whole experts a memory budget holds.

A routed-expert tensor is [n_expert, out, in] with ne0 = in contiguous, so expert e of it is one
contiguous slab of nbytes / n_expert bytes; an expert is the slabs of its layer's gate, up and down
tensors, three ranges far apart in the file.

Budget arithmetic follows ds4: sizes count in binary units (`32GB` is 32 GiB), a budget is whole
experts of the file's largest expert, and the automatic budget is 80% of the device's usable memory
minus everything that stays resident (non-routed weights, the KV cache, the scratch).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.constants import GGMLType, tensor_nbytes
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.tensors import EXPERTS, TensorSpec, expected_tensors, layer_tensor

AUTO_FRACTION = 0.8  # ds4 plans model + cached experts into 80% of the recommended working set
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class BudgetError(DwarfStarError):
    """An expert-cache budget that is malformed or cannot hold what one token needs."""


@dataclass(frozen=True)
class ExpertPart:
    """One of an expert's three matrices: where its bytes are and how to decode them."""

    name: str  # the tensor table name without the `blk.N.` prefix (EXPERTS)
    offset: int  # absolute byte offset of this expert's slab in the file
    nbytes: int
    ggml_type: GGMLType
    shape: tuple[int, int]  # [out, in]


@dataclass(frozen=True)
class ExpertLayout:
    """The byte ranges of every routed expert of a file."""

    path: str
    n_layers: int
    n_experts: int
    n_active: int  # experts one token uses per layer
    file_size: int
    parts: tuple[tuple[tuple[ExpertPart, ...], ...], ...]  # [layer][part] for expert 0; see `expert`
    strides: tuple[tuple[int, ...], ...]  # [layer][part]: bytes from one expert's slab to the next
    routed_bytes: int  # every routed expert of the file

    @classmethod
    def of(cls, gguf: GGUFFile, args: ModelArgs | ModelArgs41) -> ExpertLayout:
        parts, strides = [], []
        for il in range(args.n_layers):
            layer_parts, layer_strides = [], []
            for name in EXPERTS:
                info = gguf.tensors[layer_tensor(il, name)]
                slab = info.nbytes // args.n_routed_experts
                layer_parts.append(ExpertPart(name, info.offset, slab, info.ggml_type, info.shape[1:]))
                layer_strides.append(slab)
            parts.append(tuple(layer_parts))
            strides.append(tuple(layer_strides))
        routed = sum(p.nbytes for layer in parts for p in layer) * args.n_routed_experts
        return cls(
            str(gguf.path),
            args.n_layers,
            args.n_routed_experts,
            args.n_activated_experts,
            gguf.path.stat().st_size,
            tuple(parts),
            tuple(strides),
            routed,
        )

    def restricted(self, n_layers: int, n_experts: int, n_active: int) -> ExpertLayout:
        """The first `n_layers` layers' first `n_experts` experts, `n_active` per token: a smaller
        model's routing trace replayed over this file's expert sizes (`bench experts`)."""
        if n_layers > self.n_layers or n_experts > self.n_experts or n_active > self.n_active:
            raise ValueError(
                f"{n_layers} x {n_experts} (k {n_active}) does not fit in {self.n_layers} x {self.n_experts}"
            )
        routed = sum(self.expert_bytes(il) for il in range(n_layers)) * n_experts
        return replace(
            self,
            n_layers=n_layers,
            n_experts=n_experts,
            n_active=n_active,
            parts=self.parts[:n_layers],
            strides=self.strides[:n_layers],
            routed_bytes=routed,
        )

    def expert(self, layer: int, e: int) -> tuple[ExpertPart, ...]:
        """Expert e of `layer`: its gate, up and down slabs."""
        if not (0 <= layer < self.n_layers and 0 <= e < self.n_experts):
            raise IndexError(f"no expert {e} in layer {layer} ({self.n_layers} layers of {self.n_experts})")
        return tuple(
            ExpertPart(p.name, p.offset + e * s, p.nbytes, p.ggml_type, p.shape)
            for p, s in zip(self.parts[layer], self.strides[layer], strict=True)
        )

    def expert_bytes(self, layer: int) -> int:
        return sum(p.nbytes for p in self.parts[layer])

    @property
    def max_expert_bytes(self) -> int:
        """One cache slot holds any layer's expert, so the budget counts in the largest."""
        return max(self.expert_bytes(il) for il in range(self.n_layers))

    @property
    def total_experts(self) -> int:
        return self.n_layers * self.n_experts

    def key(self, layer: int, e: int) -> int:
        return layer * self.n_experts + e


# -- budget arithmetic -----------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """`32GB`, `512MiB`, `1.5G`, `4096` (bytes) -> bytes; binary units, as ds4 counts them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise BudgetError(f"cannot read the size {text!r}; write it like 32GB, 512MB or 4096")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def experts_for_bytes(budget_bytes: int, expert_bytes: int) -> int:
    """Whole experts a byte budget holds."""
    return max(0, budget_bytes) // expert_bytes


def auto_budget_bytes(usable: int, resident: int) -> int:
    """Bytes left for cached experts: 80% of the usable memory minus what stays resident."""
    return int(usable * AUTO_FRACTION) - resident


def check_capacity(capacity: int, n_active: int, total: int) -> int:
    """A cache must hold at least the experts one token uses in one layer: a MoE call needs them
    all at once (fewer would evict an expert the same call is about to read)."""
    if capacity < n_active:
        raise BudgetError(
            f"an expert cache of {capacity} experts is smaller than the {n_active} one token uses per layer; "
            "give a larger --ssd-streaming-cache-experts"
        )
    return min(capacity, total)


# -- the same arithmetic from a shape, without a file (ds4's published figures for Flash and PRO) ----------
def spec_bytes(spec: TensorSpec, ggml_type: GGMLType) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return tensor_nbytes(ggml_type, n, spec.shape[-1])


def split_bytes(args: ModelArgs, type_of: Callable[[TensorSpec], GGMLType]) -> tuple[int, int]:
    """(routed-expert bytes, every other tensor's bytes) of a file with these types."""
    routed = other = 0
    for spec in expected_tensors(args):
        size = spec_bytes(spec, type_of(spec))
        if spec.name.endswith(EXPERTS):
            routed += size
        else:
            other += size
    return routed, other


def routed_tensor_names(n_layers: int) -> Iterable[str]:
    return (layer_tensor(il, name) for il in range(n_layers) for name in EXPERTS)
