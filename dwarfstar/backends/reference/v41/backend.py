"""A V4.1 model on the torch reference as the session layer drives it: `model_v41.Model41` over
`ReferenceOps41`, one `SequenceState41` (float32 torch tensors on the CPU) per sequence. The cpu backend
is the same model with its weight products on the CPU kernels (`products`)."""

from __future__ import annotations

from dwarfstar.backends.reference.v41.dspark import ReferenceDSparkOps41
from dwarfstar.backends.reference.v41.model import ReferenceOps41
from dwarfstar.backends.reference.weights import FLOAT32, GGUFWeights, Products
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.model_v41 import Model41
from dwarfstar.model.state_v41 import SequenceState41, new_sequence41


class ReferenceModel41(Model41):
    @classmethod
    def from_file(
        cls, model: ModelFile41, engram_cache_bytes: int, max_seq_len: int | None = None, products: Products = FLOAT32
    ) -> ReferenceModel41:
        """The model over `model`'s weights, its Engram rows read through a cache of `engram_cache_bytes`,
        its weight products as `products` hold them (float32 here; the CPU kernels')."""
        return cls(ReferenceOps41.from_file(model, engram_cache_bytes, products), max_seq_len)

    def new_state(self) -> SequenceState41:
        return new_sequence41(self.args)

    def dspark_ops(self, args: ModelArgs41, weights: GGUFFile) -> ReferenceDSparkOps41:
        """The stages over `weights` in float32; their args name no Engram layer of theirs, so the target's
        Engram hash and store are handed on unread."""
        target = self.transformer.ops
        return ReferenceDSparkOps41(args, GGUFWeights(weights), target.hash, target.store)
