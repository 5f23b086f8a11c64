"""What `dwarfstar inspect` reports: metadata, the tensor table, totals per type, bytes read per token.

Bytes read per decoded token is the weight traffic of one decode step, which bounds decode speed on a
memory-bound machine: every layer's non-expert weights (attention, compressor, indexer, router, shared
expert, norms) in full, the routed experts' share actually used (n_activated of n_routed experts), one
row of the embedding and of the hash-routing table, and the whole output head; for DeepSeek V4.1, the 24
Engram rows per table a token looks up, read from the disk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dwarfstar.engram.hashing import COLUMNS
from dwarfstar.engram.rows import ROW_BYTES
from dwarfstar.gguf.constants import GGMLType, tensor_nbytes
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import ARCH, ModelArgs
from dwarfstar.model.config_v41 import ARCH41
from dwarfstar.model.tensors import expected_tensors
from dwarfstar.model.tensors_v41 import ENGRAM_TABLE
from dwarfstar.quant.recipes import recipe_types

_ROW_PER_TOKEN = ("token_embd.weight", "ffn_gate_tid2eid.weight")  # a token reads one row of these


@dataclass(frozen=True)
class TensorRow:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: GGMLType
    nbytes: int


@dataclass
class TokenBytes:
    """Bytes of weights read to decode one token, by kind."""

    dense: int = 0  # everything read in full: attention, compressors, indexer, router, shared expert, head
    routed: int = 0  # the activated experts' slabs
    rows: int = 0  # embedding and hash-table rows
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.dense + self.routed + self.rows


def token_bytes(tensors: Iterable[TensorRow], n_routed: int, n_activated: int) -> TokenBytes:
    out = TokenBytes()
    for t in tensors:
        if t.name.endswith("_exps.weight") and len(t.shape) == 3:
            n = t.nbytes * n_activated // n_routed
            out.routed += n
            kind = "routed experts"
        elif t.name.endswith(ENGRAM_TABLE):  # V4.1: each token looks up 24 rows of each table, from the disk
            n = COLUMNS * ROW_BYTES
            out.rows += n
            kind = "Engram rows (disk)"
        elif t.name.endswith(_ROW_PER_TOKEN):
            n = t.nbytes // t.shape[0]
            out.rows += n
            kind = "embedding/hash rows"
        else:
            n = t.nbytes
            out.dense += n
            kind = "output head" if t.name == "output.weight" else _kind(t.name)
        out.by_kind[kind] = out.by_kind.get(kind, 0) + n
    return out


def _kind(name: str) -> str:
    if "shexp" in name:
        return "shared expert"
    if "engram" in name:
        return "Engram gate/projection"
    if "compressor" in name or "indexer" in name:
        return "compressors/indexer"
    if name.startswith("blk.") and ".attn_" in name and "norm" not in name:
        return "attention"
    return "router/HC/norms"


def file_tensors(gguf: GGUFFile) -> list[TensorRow]:
    return [TensorRow(i.name, i.shape, i.ggml_type, i.nbytes) for i in gguf.tensors.values()]


def planned_tensors(args: ModelArgs, recipe: str) -> list[TensorRow]:
    """The tensors a `recipe` file of this shape would hold, without writing it."""
    types = recipe_types(args, recipe)
    return [
        TensorRow(s.name, s.shape, types[s.name], tensor_nbytes(types[s.name], math.prod(s.shape), s.shape[-1]))
        for s in expected_tensors(args)
    ]


def totals_by_type(tensors: Iterable[TensorRow]) -> dict[GGMLType, tuple[int, int]]:
    """ggml type -> (tensor count, bytes)."""
    out: dict[GGMLType, tuple[int, int]] = {}
    for t in tensors:
        count, size = out.get(t.ggml_type, (0, 0))
        out[t.ggml_type] = (count + 1, size + t.nbytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def expert_counts(metadata: Mapping[str, Any]) -> tuple[int, int] | None:
    """(n_routed, n_activated) from deepseek4 or deepseek41 metadata, or None for files of another architecture."""
    arch = metadata.get("general.architecture")
    keys = _EXPERT_KEYS.get(arch) if isinstance(arch, str) else None
    if keys is None:
        return None
    routed, used = (metadata.get(f"{arch}.{key}") for key in keys)
    if not isinstance(routed, int) or not isinstance(used, int) or not routed or not used:
        return None
    return routed, used


_EXPERT_KEYS = {ARCH: ("expert_count", "expert_used_count"), ARCH41: ("n_routed_experts", "num_experts_per_tok")}


def describe_value(value: Any, limit: int = 8) -> str:
    """A metadata value on one line: long arrays show their length and first items."""
    if isinstance(value, list):
        head = ", ".join(_short(v) for v in value[:limit])
        more = f", … ({len(value)} items)" if len(value) > limit else ""
        return f"[{head}{more}]"
    return _short(value)


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 120 else text[:117] + "…"
