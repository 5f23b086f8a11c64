"""A V4.1 model on the Triton kernels as the session layer drives it: `model_v41.Model41` over
`TritonOps41`, with each sequence's state (`SequenceState41`) on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dwarfstar.backends.triton.v41.dspark import TritonDSparkOps41
from dwarfstar.backends.triton.v41.ops import TritonOps41
from dwarfstar.backends.triton.v41.weights import upload41
from dwarfstar.engram.store import EngramStore
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.model_v41 import Model41
from dwarfstar.model.state_v41 import SequenceState41, new_sequence41

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts


class TritonModel41(Model41):
    def __init__(self, ops: TritonOps41, max_seq_len: int | None = None) -> None:
        super().__init__(ops, max_seq_len)
        self.device = ops.device

    @classmethod
    def from_file(
        cls,
        model: ModelFile41,
        engram_cache_bytes: int,
        max_seq_len: int | None = None,
        device=None,
        routed_experts: bool = True,
        host: HostExperts | None = None,
    ) -> TritonModel41:
        """The model over `model`'s weights uploaded to `device`, its Engram rows read through a cache of
        `engram_cache_bytes`. Without `routed_experts` none is uploaded: they stream from the file (the
        entry's `attach_experts` sets the source); `host`'s layers' are computed by the CPU kernels
        (`--cpu-moe`) and not uploaded either. A stage's model (`model.layers`) uploads what its slice reads."""
        held = model.layer_range  # a stage's slice: its tensors alone uploaded
        on_device = [il for il in held if routed_experts and (host is None or il not in host)]
        weights = upload41(model.gguf, model.args, torch.device(device), on_device, held, stage=True)
        store = EngramStore(model.engram, engram_cache_bytes)
        return cls(TritonOps41(weights, model.engram_hash, store, host), max_seq_len)

    def new_state(self) -> SequenceState41:
        """An empty sequence whose rows live on the device."""
        return new_sequence41(self.args, self.device)

    def dspark_ops(self, args: ModelArgs41, weights: GGUFFile) -> TritonDSparkOps41:
        """The stages on this model's device, sharing its embedding and output matrix."""
        return TritonDSparkOps41.load(self.transformer.ops, args, weights)  # type: ignore[arg-type]
