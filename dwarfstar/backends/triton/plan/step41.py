"""One V4.1 decode step on the Triton backend as it runs today, recorded without a GPU.

`TritonModel41` over `TritonOps41` runs one sequence per call, uncaptured: the step is recorded as it
runs (`eager.record_eager`), over V4.1 Flash's weights on the meta device in ds4's published types
(`synthetic.meta_weights41`) and a sequence state as after `ctx` tokens (its window, compressed rows,
index keys and frontiers on the meta device). A warm-up step at position ctx - 1 runs first, then the
step at ctx is recorded: the logits and the draw (`decode_sample`, one sampler).

The Engram rows are read on the host by a real `EngramStore` (no cache: every row a read), from a
file of the tables' real sizes written as holes (no disk used, rows read as zeros), looked up by a
real `EngramHash` (the real primes and multipliers, a stand-in token map: the plan needs the lookups'
count and bytes, not their rows).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dwarfstar.backends.triton.plan.eager import SYNC, UPLOAD, record_eager
from dwarfstar.backends.triton.plan.recorder import DecodeStep
from dwarfstar.backends.triton.v41.weights import Weights41
from dwarfstar.bench.token_bytes41 import weight_bytes_read41
from dwarfstar.engram.hashing import EngramHash, engram_multipliers, engram_primes
from dwarfstar.engram.rows import ROW_BYTES
from dwarfstar.engram.store import EngramExtent, EngramStore
from dwarfstar.errors import DwarfStarError
from dwarfstar.model import tensors as tt
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.state_v41 import SequenceState41

META = torch.device("meta")


@dataclass
class HostReads:
    """What the step read on the host from the model file (the Engram rows): SSD traffic, not HBM."""

    rows: int
    bytes: int  # bytes read from the file (whole rows, neighbours merged)
    reads: int  # positional reads issued


def decode_weight_bytes41(weights: Weights41) -> int:
    """Weight bytes one V4.1 decode step reads from device memory (`bench.token_bytes41`'s rule over the
    tensors the upload kept, in their aligned layout); the Engram tables are not on the device (`HostReads`)."""
    held = {name: w.nbytes for name, w in weights.matrices.items()}
    held |= {name: int(v.nbytes) for name, v in weights.vectors.items()}
    return weight_bytes_read41(weights.args, held, weights.matrix(None, tt.EMBED).row_bytes)


def _engram(args: ModelArgs41, folder: Path) -> tuple[EngramHash, EngramStore]:
    """A store over the tables' real sizes as holes, and a hash with the real primes and multipliers."""
    path = folder / "engram.bin"
    extents, offset = {}, 0
    for il, rows in zip(args.engram_layers, args.engram_rows, strict=True):
        extents[il] = EngramExtent(path, offset, rows)
        offset += rows * ROW_BYTES
    with open(path, "wb") as f:
        f.truncate(offset)
    compressed = args.engram_compressed_vocab
    token_map = (np.arange(args.vocab_size) % compressed).astype(np.uint32)
    multipliers = {il: engram_multipliers(il, compressed) for il in args.engram_layers}
    return EngramHash(token_map, multipliers, engram_primes(args.engram_layers, args.engram_prime_start)), EngramStore(
        extents, 0
    )


def _state_before(model, ctx: int) -> SequenceState41:
    """A sequence as after ctx - 1 tokens, its arrays on the meta device."""
    from dwarfstar.backends.reference.v41 import csa2

    args, seen = model.args, ctx - 1
    state = model.new_state()
    state.tokens = [(3 + 7919 * i) % args.vocab_size for i in range(seen)]
    for il in state.windows:
        state.windows[il] = torch.empty(min(seen, args.window - 1), args.head_dim, device=META)
    for il in args.kv_source_layers:
        ratio = args.compress_ratios[il]
        state.rows[il] = torch.empty(seen // ratio, args.head_dim, device=META)
        state.index_keys[il] = torch.empty(seen // ratio, args.index_head_dim, device=META)
        if ratio == csa2.POOLED_RATIO:
            state.frontiers[il] = tuple(part.to(META) for part in csa2.new_frontier(args.head_dim))  # type: ignore[assignment]
    return state


# the steps of `Ops41` that name their layer; the others run inside the last one named (head: none)
LAYER_STEPS = (
    "engram", "post_mix_input", "mix", "sublayer_input", "query", "window_rows", "compress", "index_scores", "attend",
    "moe",
)  # fmt: skip


def _track_layers(ops) -> Callable[[], int | None]:
    """Wrap `ops`' layer steps to note the layer running; the returned function reads it."""
    running: list[int | None] = [None]

    def noting(method, layer_of):
        def step(*args, **kwargs):
            running[0] = layer_of(args)
            return method(*args, **kwargs)

        return step

    for name in LAYER_STEPS:
        setattr(ops, name, noting(getattr(ops, name), lambda args: args[0]))
    for name in ("embed", "head"):
        setattr(ops, name, noting(getattr(ops, name), lambda args: None))
    return lambda: running[0]


def layer_launches(step: DecodeStep) -> list[dict]:
    """Per layer of a step recorded with layers: its mode, whether it reads Engram rows, and its
    launches, uploads and host reads, with each kernel's count."""
    rows = []
    for spec in step.args.layers:
        mine = [launch for launch in step.launches if launch.layer == spec.index]
        kinds = Counter(launch.kind for launch in mine)
        rows.append({
            "layer": spec.index, "mode": str(spec.mode), "ratio": spec.compress_ratio, "engram": spec.engram,
            "triton": kinds["triton"], "torch": kinds["torch"], "uploads": kinds[UPLOAD], "syncs": kinds[SYNC],
            "kernels": dict(Counter(launch.name for launch in mine if launch.kind == "triton")),
        })  # fmt: skip
    return rows


def record_decode_step41(ctx: int = 2048, layers: int | None = None, multiprocessors: int = 132) -> DecodeStep:
    """V4.1's decode step of one sequence at context `ctx` (the token at position ctx), on V4.1 Flash's
    shapes (`layers`: its layout scaled, `config_v41.layer_plan`), grids sized for `multiprocessors`."""
    from dwarfstar.backends.triton.runtime import assume_multiprocessors
    from dwarfstar.backends.triton.synthetic import meta_weights41
    from dwarfstar.backends.triton.v41.backend import TritonModel41
    from dwarfstar.backends.triton.v41.ops import TritonOps41
    from dwarfstar.sampling import Sampler, SamplingParams

    if ctx < 2:
        raise DwarfStarError(
            f"the V4.1 plan records the step after a warm-up step: --ctx must be at least 2, got {ctx}"
        )
    assume_multiprocessors(multiprocessors)
    weights = meta_weights41(layers)
    with tempfile.TemporaryDirectory(prefix="dwarfstar-plan-") as folder:
        engram_hash, store = _engram(weights.args, Path(folder))
        try:
            ops = TritonOps41(weights, engram_hash, store)
            layer = _track_layers(ops)
            model = TritonModel41(ops, max_seq_len=ctx + 1)
            state = _state_before(model, ctx)
            sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=0))

            def step() -> None:
                model.decode_sample([state.tokens[-1]], [state], [sampler])

            before = {}

            def warmup() -> None:
                step()
                before.update(store.telemetry())

            launches = record_eager(step, warmup, layer)
            after = store.telemetry()
        finally:
            store.close()
    reads = HostReads(after["misses"] - before["misses"], after["bytes_read"] - before["bytes_read"],
                      after["reads"] - before["reads"])  # fmt: skip
    return DecodeStep("v41", weights.args, 1, ctx, launches, decode_weight_bytes41(weights), False, reads)
