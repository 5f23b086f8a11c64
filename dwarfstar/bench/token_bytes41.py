"""The bytes one decoded DeepSeek V4.1 token reads (issue 33), counted as `bench.frontier` counts V4's:
`dwarfstar bench`'s GB/s on a V4.1 file and the Triton GPU plan's V4.1 step (`plan.step41`) share them.

Weights (`weight_bytes_read41`): every resident tensor but the embedding table, of which a token reads
one row, and the routed experts, of which it reads k of E per layer (6 of 384 in Flash). The Engram
tables are not memory traffic: an `EngramStore` reads their rows from the file (24 rows of 264 bytes per
Engram layer per token, `engram_rows_per_token`), so they are reported apart.

KV (`kv_bytes_read41`, CSA2 as `config_v41` lays it out): every layer reads its window (the last `window`
positions); a compressed layer (ratio 1 or 2) attends the top-k of its kv source's ctx // ratio
compressed rows, and a layer with an index query (a kv source or a reindex layer) first scores every index
key of that source; a reuse layer attends with the latest index source's top-k and scores nothing. Only
the kv sources own compressed rows and index keys (`state_v41`). Every backend's V4.1 state holds its
rows in float32 (`KV_ELEMENT_BYTES`).
"""

from __future__ import annotations

from collections.abc import Mapping

from dwarfstar.model import tensors as tt
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import ModelFile41

KV_ELEMENT_BYTES = 4  # float32 rows: the reference's, Triton's and MLX's V4.1 states


def weight_bytes_read41(args: ModelArgs41, nbytes: Mapping[str, int], embed_row_bytes: int) -> int:
    """Weight bytes one V4.1 decode token reads from memory, of tensors held as `nbytes` says (by name, the
    Engram tables not among them): all of them but the embedding, of which one row (`embed_row_bytes`), and
    the routed experts, of which k of E per layer."""
    total = sum(nbytes.values()) - nbytes[tt.EMBED] + embed_row_bytes
    for il in range(args.n_layers):
        routed = sum(nbytes[tt.layer_tensor(il, name)] for name in tt.EXPERTS)
        total -= routed - routed * args.n_activated_experts // args.n_routed_experts
    return total


def file_weight_bytes41(model: ModelFile41) -> int:
    """`weight_bytes_read41` of a V4.1 file's tensors as it stores them (quantized)."""
    tensors = model.gguf.tensors
    held = {name: info.nbytes for name, info in tensors.items() if model.holds(name)}
    return weight_bytes_read41(model.args, held, tensors[tt.EMBED].nbytes // model.args.vocab_size)


def kv_bytes_read41(args: ModelArgs41, ctx: int) -> int:
    """KV bytes one decoded V4.1 token reads at context `ctx` (see the module docstring)."""
    elements = 0
    for layer in args.layers:
        elements += min(ctx, args.window) * args.head_dim
        if layer.compress_ratio:
            rows = ctx // layer.compress_ratio
            elements += min(rows, args.index_topk) * args.head_dim
            if layer.has_index_query:
                elements += rows * args.index_head_dim
    return elements * KV_ELEMENT_BYTES


def engram_rows_per_token(args: ModelArgs41) -> int:
    """Engram rows (264 bytes each, `engram.rows.ROW_BYTES`) one token looks up, from the file or the
    store's cache, never from the weights in memory: 24 per Engram layer."""
    return len(args.engram_layers) * args.engram_columns
