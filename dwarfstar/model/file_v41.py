"""Open ds4's DeepSeek V4.1 GGUF (`deepseek41`, issue 33): the config, every tensor checked against
`tensors_v41`, and the Engram tables located but not read.

The two Engram tables (about 94 GiB each in Flash) are never mapped resident: `ModelFile41.engram`
says where each lies in the file (`EngramExtent`: absolute offset of row 0, row count) for an
`EngramStore` to read rows from with positional reads, and `ModelFile41.engram_hash` holds the
lookup tables from the metadata (token map, multipliers, primes). Every inconsistency between them
is an error at load: a table whose rows are not its primes' sum, a token map of the wrong size or
with an id past the compressed vocabulary, an even or overflowing multiplier. A truncated file is
refused by the GGUF reader already (every tensor, the tables included, must lie inside the file).

A model may also be a split set in ds4's naming (`gguf.split`: `…-Layers00-05.gguf`,
`…-Layers-06-output.gguf`), opened from any part as V4's are: each part of the same model, holding the
layers its name says, and a stage's slice mapping only the parts holding its layers. Each Engram table
lies in the part holding its layer, after that part's other tensors, and is read from there (its
`EngramExtent` names that part); `loader.write_split` writes a V4.1 model as such a set.

The engine runs these files on every backend (`engine.load.load_engine41`: `dwarfstar run`, `serve`,
`agent`, `bench` and `steer`); every other V4 command refuses them (`loader.open_model`,
`engine.load.require_v4`), and `dwarfstar inspect` describes them (`describe`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dwarfstar.engram.hashing import COLUMNS, PAD_TOKEN, SHIFTS, EngramHash, engram_multipliers, engram_primes
from dwarfstar.engram.rows import ROW_BYTES
from dwarfstar.engram.store import EngramExtent
from dwarfstar.errors import ConfigError, ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.split import GGUFSet, PartName, check_not_llama_split, layer_span, open_parts
from dwarfstar.model.config import ARCH
from dwarfstar.model.config_v41 import ARCH41, LayerMode, ModelArgs41
from dwarfstar.model.tensors import stage_needs
from dwarfstar.model.tensors_v41 import engram_table, is_engram_table, validate_tensors41

FAMILY41 = "DeepSeek V4.1 Flash"
NOT_YET = "but only `dwarfstar run`, `serve`, `agent`, `bench` and `steer` run it yet (issue 33)"


@dataclass
class ModelFile41:
    """A validated V4.1 model, one file or the parts of a split set: its weights stay memory-mapped until
    read, its Engram tables on the disk."""

    path: Path  # the file it was opened from (for a split set, the part named)
    gguf: GGUFFile | GGUFSet
    args: ModelArgs41
    engram: dict[int, EngramExtent]  # each held Engram layer -> where its table lies, in the file holding it
    engram_hash: EngramHash
    layers: range | None = None  # the layers a stage mapped; None: every layer
    parts: tuple[Path, ...] = ()  # the files mapped, in layer order

    @property
    def layer_range(self) -> range:
        return range(self.args.n_layers) if self.layers is None else self.layers

    @property
    def engram_bytes(self) -> int:
        """The tables' bytes: read row by row from the disk, never resident."""
        return sum(extent.nbytes for extent in self.engram.values())

    @property
    def resident_bytes(self) -> int:
        """Every tensor a backend loads (`holds`)."""
        return sum(info.nbytes for name, info in self.gguf.tensors.items() if self.holds(name))

    def holds(self, tensor_name: str) -> bool:
        """Whether a backend loading this model reads the tensor: its layers' (every layer's, or a stage's:
        `tensors.stage_needs`, as `loader.ModelFile.holds` says it of a V4 file's) but the Engram tables."""
        if is_engram_table(tensor_name):
            return False
        return stage_needs(tensor_name, self.args.n_layers, self.layer_range)

    def summary(self) -> str:
        return (
            f"{self.args.n_layers} layers, {self.resident_bytes:,} bytes of weights, Engram tables of "
            f"{self.engram_bytes:,} bytes on disk"
        )

    def close(self) -> None:
        self.gguf.close()


def family_problem(metadata: Mapping[str, Any]) -> str | None:
    """Why a file's metadata contradicts its own architecture name ("mislabelled"), or None."""
    arch = metadata.get("general.architecture")
    v41 = any(key.startswith(f"{ARCH41}.") for key in metadata)
    v4 = any(key.startswith(f"{ARCH}.") for key in metadata)
    if arch == ARCH41 and v4 and not v41:
        return f"mislabelled: general.architecture says {ARCH41!r} (V4.1) but its keys are DeepSeek V4's {ARCH}.*"
    if arch == ARCH and v41:
        return f"mislabelled: general.architecture says {ARCH!r} (V4) but it carries DeepSeek V4.1's {ARCH41}.* keys"
    return None


def open_model41(path: str | os.PathLike, layers: tuple[int, int] | None = None) -> ModelFile41:
    """Open and validate a V4.1 file, or the split set `path` is a part of (ds4's naming, `gguf.split`),
    with a clear ModelFileError for anything else. `layers=(first, end)` (end exclusive) maps and validates
    only those layers, with the embedding when `first` is 0 and the head when `end` is the last layer:
    from a set, only the parts holding them (`split.open_parts`); `engram` then has their tables only."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    named = PartName.of(path)
    head = GGUFFile(path if named is None else named.path)
    try:
        check_not_llama_split(head)
        args = _config41(head.metadata, path)
        span = layer_span(args.n_layers, layers, path)
    except BaseException:
        head.close()
        raise
    gguf = head if named is None else open_parts(named, head, args.n_layers, span.start, span.stop)
    try:
        return read_model41(gguf, path, None if layers is None else span)
    except BaseException:
        gguf.close()
        raise


def read_model41(gguf: GGUFFile | GGUFSet, path: Path | None = None, layers: range | None = None) -> ModelFile41:
    """The V4.1 model in an opened file or set of parts (which the caller closes on error), named `path` in
    errors (default: the first file's); `layers`: a stage's slice (`open_model41`)."""
    files = gguf.parts if isinstance(gguf, GGUFSet) else (gguf,)
    path = files[0].path if path is None else path
    args = _config41(gguf.metadata, path)
    try:
        engram_hash = read_engram_hash(gguf.metadata, args)
        validate_tensors41(args, gguf.tensors, layers)
    except (ConfigError, ModelFileError) as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    held = range(args.n_layers) if layers is None else layers
    parts = tuple(part.path for part in files)
    return ModelFile41(path, gguf, args, _engram_extents(files, args, held), engram_hash, layers, parts)


def config41(path: str | os.PathLike) -> ModelArgs41:
    """The config in the header of the V4.1 file, or part of a set, `path` (its tensors unchecked)."""
    with GGUFFile(path) as gguf:
        return _config41(gguf.metadata, Path(path))


def _config41(meta: Mapping[str, Any], path: Path) -> ModelArgs41:
    if problem := family_problem(meta):
        raise ModelFileError(f"{path}: {problem}")
    if meta.get("general.architecture") == ARCH:
        raise ModelFileError(f"{path} is DeepSeek V4 ({ARCH!r}), not {FAMILY41} ({ARCH41!r})")
    try:
        return ModelArgs41.from_gguf_metadata(meta)
    except ConfigError as exc:
        raise ModelFileError(f"{path}: {exc}") from exc


def _engram_extents(files: Sequence[GGUFFile], args: ModelArgs41, held: range) -> dict[int, EngramExtent]:
    """Where the tables of the Engram layers `held` lie: each in the file (the part of a set) holding its
    layer, which stores its tables after every other tensor of its own (the pages a backend maps resident
    end before them)."""
    extents = {}
    for gguf in files:
        tables = {il: gguf.tensors[engram_table(il)] for il in args.engram_layers if engram_table(il) in gguf.tensors}
        if not tables:
            continue
        first_table = min(info.offset for info in tables.values())
        others = [info for info in gguf.tensors.values() if info.name not in {t.name for t in tables.values()}]
        late = [info.name for info in others if info.offset + info.nbytes > first_table]
        if late:
            where = f"{gguf.path}: {late[0]!r}"
            raise ModelFileError(f"{where} is stored after an Engram table; ds4 stores the tables last")
        extents |= {il: EngramExtent(gguf.path, t.offset, t.shape[0]) for il, t in tables.items() if il in held}
    return extents


# -- the Engram hash tables in the metadata ---------------------------------------------------------------
TOKEN_MAP, PRIMES, MULTIPLIERS = (f"{ARCH41}.engram.{key}" for key in ("token_map", "primes", "multipliers"))


def engram_hash_metadata(engram_hash: EngramHash, layers: tuple[int, ...]) -> dict[str, tuple[ValueType, Any]]:
    """The token map (u32 per token), the primes (u32, 24 per layer) and multipliers (u64, 4 per layer),
    the layers in `layers`' order, as ds4 writes them."""
    primes = np.concatenate([engram_hash.primes[il] for il in layers])
    multipliers = np.concatenate([engram_hash.multipliers[il] for il in layers])
    return {
        TOKEN_MAP: (ValueType.ARRAY, (ValueType.UINT32, engram_hash.token_map.tolist())),
        PRIMES: (ValueType.ARRAY, (ValueType.UINT32, primes.tolist())),
        MULTIPLIERS: (ValueType.ARRAY, (ValueType.UINT64, multipliers.tolist())),
    }


def model_engram_hash(args: ModelArgs41, token_map: np.ndarray) -> EngramHash:
    """The lookup tables of a model with config `args` whose tokenizer compresses to `token_map`
    (`compressed_token_map`): the primes from `args.engram_prime_start` and the reference's multipliers,
    checked against the config's compressed vocabulary and table rows (ConfigError)."""
    compressed = int(token_map.max()) + 1
    if compressed != args.engram_compressed_vocab:
        raise ConfigError(
            f"the tokenizer compresses {token_map.size} tokens to {compressed} ids, but the config says "
            f"{args.engram_compressed_vocab}"
        )
    primes = engram_primes(args.engram_layers, args.engram_prime_start)
    multipliers = {il: engram_multipliers(il, compressed) for il in args.engram_layers}
    engram = EngramHash(token_map, multipliers, primes)
    rows = tuple(engram.table_rows(il) for il in args.engram_layers)
    if rows != args.engram_rows:
        raise ConfigError(f"primes from {args.engram_prime_start} give tables of {rows} rows, not {args.engram_rows}")
    return engram


def read_engram_hash(meta: Mapping[str, Any], args: ModelArgs41) -> EngramHash:
    """The lookup tables of a V4.1 file's metadata, checked against its config (ConfigError)."""
    n = len(args.engram_layers)
    token_map = _array(meta, TOKEN_MAP, args.vocab_size, "one compressed id per token")
    if token_map.size and token_map.max() >= args.engram_compressed_vocab:
        token = int(np.argmax(token_map >= args.engram_compressed_vocab))
        raise ConfigError(
            f"{TOKEN_MAP} maps token {token} to {token_map[token]}, past the compressed vocabulary of "
            f"{args.engram_compressed_vocab}"
        )
    if token_map[PAD_TOKEN] != args.engram_pad_id:
        raise ConfigError(
            f"{TOKEN_MAP} maps the pad token {PAD_TOKEN} to {token_map[PAD_TOKEN]}, but the Engram pad id is "
            f"{args.engram_pad_id}"
        )
    primes = _array(meta, PRIMES, COLUMNS * n, f"{COLUMNS} per Engram layer").reshape(n, COLUMNS)
    multipliers = _array(meta, MULTIPLIERS, SHIFTS * n, f"{SHIFTS} per Engram layer").reshape(n, SHIFTS)
    bound = (2**63 - 1) // args.engram_compressed_vocab  # a compressed id times one must fit in int64
    for il, rows, mine, mults in zip(args.engram_layers, args.engram_rows, primes, multipliers, strict=True):
        if (mine < 2).any() or int(mine.sum()) != rows:
            raise ConfigError(
                f"layer {il}'s Engram table has {rows} rows, but its {COLUMNS} primes in {PRIMES} sum to "
                f"{int(mine.sum())}: each head's rows are one prime's worth"
            )
        if (mults % 2 == 0).any() or (mults > bound).any():
            raise ConfigError(
                f"layer {il}'s Engram multipliers {mults.tolist()} must be odd and at most {bound} (no overflow)"
            )
    return EngramHash(
        token_map=token_map.astype(np.uint32),
        multipliers={il: m.astype(np.int64) for il, m in zip(args.engram_layers, multipliers, strict=True)},
        primes={il: p.astype(np.int64) for il, p in zip(args.engram_layers, primes, strict=True)},
    )


def _array(meta: Mapping[str, Any], key: str, size: int, what: str) -> np.ndarray:
    value = meta.get(key)
    if value is None:
        raise ConfigError(f"GGUF metadata is missing required key {key!r}")
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"GGUF key {key!r} must be an array of integers")
    if len(value) != size:
        raise ConfigError(f"{key} has {len(value)} entries, expected {size} ({what})")
    return np.array(value, dtype=np.uint64)


# -- what `inspect` shows ----------------------------------------------------------------------------------
def describe(model: ModelFile41) -> list[str]:
    """The family, each layer's mode and sources, and the Engram tables' bytes, resident vs on disk."""
    args = model.args
    lines = [
        f"{FAMILY41} ({ARCH41}): {args.n_layers} layers, hidden {args.dim}, {args.n_routed_experts} routed experts "
        f"({args.n_activated_experts} active), window {args.window}, index top-k {args.index_topk}, candidate "
        f"blocks {args.candidate_topk_blocks} of {args.candidate_block_size}",
        "layer modes (ratio, mode, compressed rows read, top-k used):",
    ]
    for spec in args.layers:
        line = f"  {spec.index:3d}  ratio {spec.compress_ratio}  {spec.mode:8}"
        if spec.mode != LayerMode.WINDOW:
            line += f"  rows of {spec.kv_source:<3d} top-k of {spec.index_source:<3d}"
        flags = [
            "builds candidates" * spec.builds_candidates,
            "picks inside candidates" * spec.uses_candidates,
            "Engram" * spec.engram,
        ]
        lines.append(" ".join([line.rstrip(), *filter(None, flags)]))
    for il, extent in model.engram.items():
        lines.append(
            f"Engram layer {il}: {extent.rows:,} rows of {ROW_BYTES} bytes = {extent.nbytes:,} bytes on disk from byte "
            f"{extent.offset:,} (read per lookup, never resident)"
        )
    stats = [path.stat() for path in model.parts]
    files = "file" if len(stats) == 1 else f"{len(stats)} parts"
    lines.append(
        f"bytes: {model.resident_bytes:,} resident (weights), {model.engram_bytes:,} on disk (Engram tables); "
        f"{files} {sum(s.st_size for s in stats):,} bytes, {sum(s.st_blocks for s in stats) * 512:,} allocated"
    )
    return lines
