"""Convert a DeepSeek V4.1 Flash checkpoint into ds4's `deepseek41` GGUF (issue 33 item 2).

The checkpoint (Hugging Face `deepseek-ai/DeepSeek-V4.1-Flash`, config.json `model_type` deepseek_v41)
differs from V4's in what `convert.hf` needs to know:

* **config.json** nests the language model under `text_config` (`ModelArgs41.from_hf_config`); its
  `compress_ratios` go on past the layers with the DSpark stages' entries.
* **FP8 blocks** are 32x32 (V4's are 128x128); `Checkpoint.read` takes the size from each scale's shape.
* **Tensors** follow `tensors_v41`: compressors and indexers only on their source layers, the image-route
  bias `ffn.gate.bias_vl`, and on the Engram layers `engram.{q_weight, k_weight, wkv}` and the table
  `engram.embed` (FP8 e4m3 values [rows, 256] with an E8M0 scale per 32, [rows, 8]).
* **The Engram table** is copied as stored, never decoded: each row's 256 value bytes then its 8 scale
  bytes are ds4's 264-byte row (`engram.rows`), written after every other tensor, in bands of rows.
* **The hash tables** (token map, primes, multipliers) are computed from the tokenizer and the config
  (`engram.hashing.model_engram_hash`) and stored in the metadata, checked against the config's table
  rows and compressed vocabulary, as ds4's converter stores them.

The DSpark stages (`mtp.*`) and the vision tower are not part of this file: `--dspark FILE` writes the
drafter as its support file (`model.dspark_v41`: the stages as layers after the trunk's, with their own
expert count), `--vision FILE` the encoder; without them the skipped-tensor note lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dwarfstar.convert.checkpoint import Checkpoint, CheckpointTensor
from dwarfstar.convert.hf_config import dspark_args_from_hf_config
from dwarfstar.engram.hashing import compressed_token_map
from dwarfstar.engram.rows import ROW_BYTES, ROW_SCALES, ROW_VALUES
from dwarfstar.errors import ConfigError, ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.dspark_v41 import DSparkArgs41
from dwarfstar.model.file_v41 import engram_hash_metadata, model_engram_hash
from dwarfstar.model.tensors import TensorSpec
from dwarfstar.model.tensors_v41 import V41_ALIGNMENT, expected_tensors41
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json, bundled_v41_tokenizer_metadata, tokenizer_metadata

EXPERTS_KEY, TOP_K_KEY = "dspark_n_routed_experts", "dspark_num_experts_per_tok"  # the drafter's own
ENGRAM_BAND_ROWS = 1 << 16  # rows copied per piece: 17 MB of a table of 384 million


def engram_source(checkpoint: Checkpoint, spec: TensorSpec, name: str) -> CheckpointTensor:
    """The checkpoint's Engram table for GGUF tensor `spec` (rows x 264 bytes): FP8 values [rows, 256]
    with E8M0 scales [rows, 8], refused with the name and what was found otherwise."""
    source = checkpoint.tensors[name]
    rows = spec.shape[0]
    scale = source.scale
    if (
        source.data.dtype != "F8_E4M3"
        or source.data.shape != (rows, ROW_VALUES)
        or scale is None
        or scale.dtype != "F8_E8M0"
        or scale.shape != (rows, ROW_SCALES)
    ):
        found = f"{source.data.dtype} {list(source.data.shape)}"
        found += ", no scale" if scale is None else f" with {scale.dtype} scales {list(scale.shape)}"
        raise ModelFileError(
            f"checkpoint tensor {name!r} is {found}; {spec.name} needs FP8 E4M3 [{rows}, {ROW_VALUES}] with "
            f"E8M0 scales [{rows}, {ROW_SCALES}] (config.json's engram_num_embeddings)"
        )
    return source


def engram_rows(checkpoint: Checkpoint, source: CheckpointTensor) -> Iterator[np.ndarray]:
    """The table's rows as ds4 stores them ([n, 264] uint8: 256 value bytes, then 8 scale bytes), a band
    of rows at a time."""
    rows = source.data.shape[0]
    for start in range(0, rows, ENGRAM_BAND_ROWS):
        values, scales = checkpoint.read_row_bytes(source, slice(start, min(start + ENGRAM_BAND_ROWS, rows)))
        out = np.empty((values.shape[0], ROW_BYTES), dtype=np.uint8)
        out[:, :ROW_VALUES], out[:, ROW_VALUES:] = values, scales
        yield out


def v41_layout(
    src: Path, config: dict[str, Any], tokenizer: Path | None, dspark: bool = False
) -> tuple[ModelArgs41, list[TensorSpec], dict[str, tuple[ValueType, Any]], list[str]]:
    """What a V4.1 conversion writes, before any tensor is read: the config, the tensors in ds4's order,
    the metadata that does not depend on the output type (config, Engram hash tables, vocabulary,
    ds4's alignment), and notes. `tokenizer`: the checkpoint's tokenizer.json, or None for the bundled
    one (V4's, with V4.1's `<｜System｜>` named). `dspark`: the drafter is converted too (else a note says
    it is there)."""
    args = ModelArgs41.from_hf_config(config)
    notes: list[str] = []
    if tokenizer is None:
        notes.append(f"no tokenizer.json in {src}: using the bundled DeepSeek V4 tokenizer with V4.1's <｜System｜>")
        vocabulary = bundled_v41_tokenizer_metadata(args.vocab_size)
    else:
        vocabulary = tokenizer_metadata(tokenizer, args.vocab_size)
    tokens = Tokenizer.from_tokenizer_json(tokenizer or bundled_tokenizer_json(), args.vocab_size)
    metadata = args.to_gguf_metadata()
    metadata.update(engram_hash_metadata(model_engram_hash(args, compressed_token_map(tokens)), args.engram_layers))
    metadata.update(vocabulary)
    metadata["general.alignment"] = (ValueType.UINT32, V41_ALIGNMENT)
    if config["text_config"].get("dspark_block_size") and not dspark:
        notes.append("the checkpoint has a DSpark drafter (mtp.*): --dspark FILE writes it as its support file")
    return args, list(expected_tensors41(args)), metadata, notes


def dspark_args41_from_hf_config(text: dict[str, Any], args: ModelArgs41) -> DSparkArgs41:
    """A V4.1 checkpoint's drafter (config.json's `text_config`): V4's `dspark_*` settings, its stages the
    `compress_ratios` entries past the layers, and the stages' own routed experts and top-k
    (`dspark_n_routed_experts`, `dspark_num_experts_per_tok`), checked against the trunk."""
    d = dspark_args_from_hf_config(text, args)
    for key in (EXPERTS_KEY, TOP_K_KEY):
        if not isinstance(text.get(key), int) or isinstance(text.get(key), bool) or text[key] <= 0:
            raise ConfigError(f"config.json text_config: {key} must be a positive integer, got {text.get(key)!r}")
    if text[TOP_K_KEY] > text[EXPERTS_KEY]:
        raise ConfigError(
            f"config.json text_config: the drafter routes to {text[TOP_K_KEY]} of {text[EXPERTS_KEY]} experts"
        )
    return DSparkArgs41(d, text[EXPERTS_KEY], text[TOP_K_KEY])
