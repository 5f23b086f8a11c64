"""Importance matrices (imatrix): collecting them from a model, and the file format.

What is collected (as ds4's `--imatrix-out` does): for every routed expert, the mean square of each input
column of its matrices, counted only over the tokens the router sent to that expert. Gate and up see the
FFN-normalised hidden state; down sees the expert's SwiGLU output after the route weight is applied.
An expert that no token reached gets all ones (no preference among columns).

File format: llama.cpp's legacy binary imatrix `.dat`, laid out as ds4 writes it (little-endian):

    i32 n_entries
    n_entries × { i32 name_len, name bytes (the GGUF tensor name, e.g. "blk.3.ffn_up_exps.weight"),
                  i32 ncall, i32 n_values, f32 values[n_values] }
    i32 chunks, i32 dataset_len, dataset bytes          (optional trailer)

A routed tensor's entry packs its experts one after another: n_values = n_expert × n_columns, expert e's
vector at values[e·n_columns:]. Values are mean squares divided by ncall (ds4 writes means with ncall = 1;
llama.cpp writes sums with ncall = the number of chunks, which reads back the same). `chunks` counts the
prompts that went in; `dataset` names the prompt file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.gguf.reader import TensorInfo
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import ModelFile

EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


class ImatrixError(DwarfStarError):
    """An imatrix file that is malformed or was made for another model."""


@dataclass
class Imatrix:
    entries: dict[str, torch.Tensor]  # tensor name -> float32 (n_values,), already divided by ncall
    chunks: int = 0
    dataset: str = ""
    source: str = ""  # the file it was read from, recorded in quantized files

    def importance(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The importance for a tensor of torch shape `shape`, broadcastable to it, or None if absent:
        (n_expert, 1, cols) for routed experts, (cols,) for a 2-D tensor."""
        values = self.entries.get(name)
        if values is None:
            return None
        if len(shape) == 3:
            return values.reshape(shape[0], 1, shape[-1])
        return values


def check_imatrix(imatrix: Imatrix, tensors: Mapping[str, TensorInfo]) -> None:
    """Raise ImatrixError unless every entry names a tensor of this model with the right length."""
    for name, values in imatrix.entries.items():
        info = tensors.get(name)
        if info is None:
            raise ImatrixError(f"imatrix entry {name!r} is not a tensor of this model: was it made for another one?")
        want = info.shape[-1] * (info.shape[0] if len(info.shape) == 3 else 1)
        if values.numel() != want:
            raise ImatrixError(
                f"imatrix entry {name!r} has {values.numel()} values, but this model's tensor of shape "
                f"{list(info.shape)} needs {want}: was it made for another model?"
            )


def read_imatrix(path: str | os.PathLike) -> Imatrix:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ImatrixError(f"cannot read imatrix {path}: {exc.strerror or exc}") from None
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise ImatrixError(f"{path}: truncated imatrix file (reading {what} at byte {pos})")
        pos += n
        return data[pos - n : pos]

    def i32(what: str) -> int:
        return struct.unpack("<i", take(4, what))[0]

    n_entries = i32("the entry count")
    if n_entries < 1:
        raise ImatrixError(f"{path}: not an imatrix file ({n_entries} entries)")
    entries = {}
    for i in range(n_entries):
        name_len = i32(f"entry {i}'s name length")
        if not 0 < name_len <= 4096:
            raise ImatrixError(f"{path}: not an imatrix file (entry {i} has a name of {name_len} bytes)")
        name = take(name_len, f"entry {i}'s name").decode("utf-8", errors="replace")
        ncall, n_values = i32(f"{name}'s call count"), i32(f"{name}'s value count")
        if n_values < 1:
            raise ImatrixError(f"{path}: entry {name!r} has {n_values} values")
        values = torch.from_numpy(np.frombuffer(take(4 * n_values, f"{name}'s values"), dtype="<f4").copy())
        if ncall > 0:
            values /= ncall
        if not torch.isfinite(values).all() or (values < 0).any():
            raise ImatrixError(f"{path}: entry {name!r} has negative or non-finite values")
        entries[name] = values
    chunks, dataset = 0, ""
    if pos < len(data):
        chunks = i32("the chunk count")
        dataset = take(i32("the dataset name length"), "the dataset name").decode("utf-8", errors="replace")
    return Imatrix(entries, chunks, dataset, str(path))


def write_imatrix(path: str | os.PathLike, imatrix: Imatrix) -> None:
    parts = [struct.pack("<i", len(imatrix.entries))]
    for name, values in imatrix.entries.items():
        raw = name.encode()
        parts.append(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", 1, values.numel()))
        parts.append(values.float().numpy().astype("<f4").tobytes())
    dataset = imatrix.dataset.encode()
    parts.append(struct.pack("<ii", imatrix.chunks, len(dataset)) + dataset)
    Path(path).write_bytes(b"".join(parts))


class ImatrixCollector:
    """Accumulates Σ x² per (expert tensor, expert, column) and the routed-token counts.

    It is the MoE observer of the reference backend: called with the layer index, the expert tensor's
    name, the expert id and the rows that expert's matrix multiplies.
    """

    def __init__(self, args: ModelArgs) -> None:
        self.args = args
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        for il in range(args.n_layers):
            for tensor in EXPERT_TENSORS:
                cols = args.moe_inter_dim if tensor.startswith("ffn_down") else args.dim
                self.sums[f"blk.{il}.{tensor}"] = torch.zeros(args.n_routed_experts, cols, dtype=torch.float64)
                self.counts[f"blk.{il}.{tensor}"] = torch.zeros(args.n_routed_experts, dtype=torch.int64)

    def __call__(self, layer: int, tensor: str, expert: int, rows: torch.Tensor) -> None:
        name = f"blk.{layer}.{tensor}"
        self.sums[name][expert] += rows.double().square().sum(0)
        self.counts[name][expert] += rows.shape[0]

    def result(self, chunks: int, dataset: str) -> Imatrix:
        entries = {}
        for name, sums in self.sums.items():
            counts = self.counts[name].unsqueeze(1)
            means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.ones_like(sums))
            entries[name] = means.float().reshape(-1)
        return Imatrix(entries, chunks, dataset)


def collect_imatrix(
    model_file: ModelFile,
    prompts: Iterable[list[int]],
    dataset: str,
    progress: Callable[[int, int], None] | None = None,
) -> Imatrix:
    """Run every prompt through the reference model (each from an empty context) and collect."""
    from dwarfstar.backends.reference.model import ReferenceModel

    model = ReferenceModel(model_file)
    collector = ImatrixCollector(model.args)
    model.ops.expert_observer = collector
    n_prompts = n_tokens = 0
    for tokens in prompts:
        model.forward(tokens, model.new_state())
        n_prompts += 1
        n_tokens += len(tokens)
        if progress:
            progress(n_prompts, n_tokens)
    if n_prompts == 0:
        raise ImatrixError("the prompt file holds no prompts")
    return collector.result(n_prompts, dataset)
