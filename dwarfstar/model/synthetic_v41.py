"""Deterministic random-weight DeepSeek V4.1 files in ds4's `deepseek41` layout (issue 33), for tests and
benches: `dwarfstar synth --preset v41-tiny` or `v41-shaped`; and a random DSpark drafter for one
(`write_synthetic_dspark41`, `TINY_DSPARK41` for `v41-tiny`).

* `v41-tiny`: every V4.1 mechanism at toy size (the spec's §7 layout): hidden 64, 12 layers with ratios
  0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1; kv sources 2, 4, 6 (so reuse layers change source), index sources
  2, 4, 6, 8, 10 (8 and 10 reindex inside layer 6's candidate blocks: 3 blocks of 2), window 8, top-k 4,
  and Engram on layers 1 and 6. The Engram shape is the real one (8 heads of 256 dims, 2- to 4-grams: the
  264-byte row and the hash are fixed by ds4), with small tables: the primes past 64 instead of 16M
  (2,946 and 6,076 rows). The token map is the real one computed from the bundled tokenizer (99,092
  compressed ids), since the tiny model keeps the real 129,280-token vocabulary; the multipliers are the
  reference's draws for layers 1 and 6. Table rows are random values stored as real rows
  (`engram.rows.quantize`).
* `v41-shaped`: V4.1 Flash's own dimensions with 4 layers (window, window, ratio-2 owner, ratio-1
  candidate source; `--layers N` scales Flash's layout, `config_v41.layer_plan`), in ds4's published
  types by default. Its two Engram tables have Flash's row counts (384,006,168 and 384,016,682 rows,
  94.4 GiB each): they are written as holes (sparse regions that read as zero rows), so the file's
  size counts them but the disk holds none of their bytes.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from dwarfstar.engram.hashing import compressed_token_map, engram_primes
from dwarfstar.engram.rows import ROW_VALUES, quantize
from dwarfstar.gguf.constants import ValueType
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config_v41 import ModelArgs41, layer_plan
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.dspark_v41 import DSparkArgs41, dspark_tensors41, support_metadata41
from dwarfstar.model.file_v41 import engram_hash_metadata, model_engram_hash
from dwarfstar.model.synthetic import DSPARK_SEED_OFFSET, layout_experts, tensor_chunks, tensor_type, write_draft
from dwarfstar.model.tensors_v41 import ENGRAM_ROWS, V41_ALIGNMENT, expected_tensors41
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json, bundled_v41_tokenizer_metadata

TINY_ENGRAM_LAYERS = (1, 6)
TINY_PRIME_START = 64
ENGRAM_ROWS_PER_CHUNK = 1 << 16


def _prime_rows(layers: tuple[int, ...], start: int) -> tuple[int, ...]:
    primes = engram_primes(layers, start)
    return tuple(int(primes[il].sum()) for il in layers)


V41_TINY = ModelArgs41(
    n_layers=12,
    dim=64,
    n_heads=4,
    head_dim=128,
    rope_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=8,
    n_activated_experts=2,
    moe_inter_dim=32,
    window=8,
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1),
    kv_source_layers=(2, 4, 6),
    index_source_layers=(2, 4, 6, 8, 10),
    candidate_source_layer=6,
    candidate_topk_blocks=3,
    candidate_block_size=2,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=4,
    max_seq_len=65536,
    engram_layers=TINY_ENGRAM_LAYERS,
    engram_rows=_prime_rows(TINY_ENGRAM_LAYERS, TINY_PRIME_START),
    engram_prime_start=TINY_PRIME_START,
)
V41_SHAPED = ModelArgs41().with_plan(layer_plan(4))

V41_PRESETS: dict[str, ModelArgs41] = {"v41-tiny": V41_TINY, "v41-shaped": V41_SHAPED}
V41_HOLES = {"v41-shaped"}  # presets whose Engram tables are written as holes
V41_LAYOUT = {"v41-tiny": "f32", "v41-shaped": "ds4"}  # the layout each writes without --layout


def v41_preset(preset: str, n_layers: int | None = None) -> ModelArgs41:
    """A V4.1 preset, with `n_layers` layers in Flash's scaled layout when given."""
    args = V41_PRESETS[preset]
    return args if n_layers is None else args.with_plan(layer_plan(n_layers))


# v41-tiny's drafter: Flash's shape of settings (the last three layers' inputs, 3 stages, blocks of 5) with
# its own expert count and top-k, unlike the trunk's 8 and 2 (Flash: 128 and 3 beside 384 and 6)
TINY_DSPARK41 = DSparkArgs41(
    DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(9, 10, 11), stages=3),
    n_experts=6,
    top_k=3,
)


@functools.cache
def _token_map(vocab_size: int) -> np.ndarray:
    return compressed_token_map(Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), vocab_size))


def write_synthetic_v41(
    path: str | os.PathLike,
    args: ModelArgs41,
    layout: str = "f32",
    seed: int = 0,
    name: str = "synthetic-v41",
    engram_holes: bool = False,
) -> None:
    """Write a random V4.1 model; the same arguments always give the same bytes. `engram_holes` leaves
    the Engram tables as holes (zero rows, no disk) instead of random rows."""
    metadata = args.to_gguf_metadata()
    metadata["general.name"] = (ValueType.STRING, name)
    metadata.update(engram_hash_metadata(model_engram_hash(args, _token_map(args.vocab_size)), args.engram_layers))
    metadata.update(bundled_v41_tokenizer_metadata(args.vocab_size))
    experts = layout_experts(layout)
    specs = [(spec, tensor_type(spec, layout, experts)) for spec in expected_tensors41(args)]
    with GGUFWriter(path, metadata, alignment=V41_ALIGNMENT) as writer:
        for spec, ggml_type in specs:
            writer.add_tensor(spec.name, spec.shape, ggml_type)
        for index, (spec, ggml_type) in enumerate(specs):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
            if spec.types != ENGRAM_ROWS:
                writer.write_tensor(spec.name, tensor_chunks(spec, ggml_type, args, gen))
            elif engram_holes:
                writer.skip_tensor(spec.name)
            else:
                writer.write_tensor(spec.name, _engram_rows(spec.shape[0], gen))


def _engram_rows(rows: int, gen: torch.Generator):
    """Random N(0, 1) rows stored as ds4 stores them (256 E4M3 values, 8 E8M0 scales)."""
    for start in range(0, rows, ENGRAM_ROWS_PER_CHUNK):
        count = min(ENGRAM_ROWS_PER_CHUNK, rows - start)
        yield quantize(torch.randn(count, ROW_VALUES, generator=gen).numpy())


def write_synthetic_dspark41(
    path: str | os.PathLike, args: ModelArgs41, d: DSparkArgs41, layout: str = "f32", seed: int = 0
) -> None:
    """A random V4.1 DSpark drafter for the target `args`: a support GGUF (`dspark_v41`) of `mtp.{0..}.*`
    tensors; the same arguments write the same bytes."""
    metadata = support_metadata41(d, "synthetic-dspark41")
    write_draft(path, args, metadata, dspark_tensors41(args, d), layout, seed * 1_000_003 + DSPARK_SEED_OFFSET)
