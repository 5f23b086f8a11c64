"""The Triton backend as the session layer drives it: `TritonModel` (the shared forward pass over
`TritonOps`) with decode steps replayed from graphs and sampling on the device.

Weights are uploaded once from the memory-mapped GGUF, in their blocks; the KV cache lives on the
device. Every decode step runs batch-native, a KV-cache block at a time (one sequence alone too:
a step has the same bits whatever its company); those of the first block on a GPU replay a graph
per batch-size bucket (`graphs.DecodeGraphs`, which runs the forward pass's own
`batch`/`compute`/`advance`); prefill chunks, CPU runs and the lower entry points a pipeline stage
or a draft drives (`embed`, `run_layers`, `forward_streams`...) go through the eager kernels.

Portability: the kernels use only Triton's portable language (no inline assembly, no libdevice
calls, no fp8 conversion instructions), and `aot_check` compiles all of them for sm_90 and gfx942
(gfx1151 and sm_121 compiled too, by hand). CUDA-only parts: the graph capture goes through
`torch.cuda.CUDAGraph`, which ROCm builds of torch map to HIP graphs (never run here), and the
register/spill report of `aot_check` reads CUDA binaries. Nothing here has run on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dwarfstar.backends.triton.kernels.sampling import candidates_for, knob_rows, redraw_overflow, sample_rows
from dwarfstar.backends.triton.model import TritonModel
from dwarfstar.backends.triton.runtime import EXACT, Precision, default_device
from dwarfstar.backends.triton.weights import ModelWeights, upload
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import Sampler, read_draws

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts


class TritonBackend(TritonModel):
    """The forward pass over `TritonOps` (it is the model, as every backend is), with its decode steps
    replayed from graphs where they serve the states and its sampling on the device."""

    def __init__(
        self,
        weights: ModelWeights,
        qat: bool = True,
        precision: Precision = EXACT,
        graphs: bool = True,
        max_seq_len: int | None = None,
        kv_slots: int = 4,
        host: HostExperts | None = None,
    ):
        """`kv_slots`: sequences of the first KV-cache block, which decode together (one graph replay).
        `host`: the layers whose routed experts the CPU kernels compute (`--cpu-moe`); their steps run
        eagerly, not from graphs (the host's part cannot be captured)."""
        # on the meta device too: `warm` records the steps a GPU's graphs would replay
        graphs = graphs and host is None and weights.device.type in ("cuda", "meta")
        slots = kv_slots + 1 if graphs else kv_slots  # graphs pad their buckets on one more slot
        options = dict(qat=qat, precision=precision, max_seq_len=max_seq_len, kv_slots=slots, host=host)
        super().__init__(weights, **options)
        self.graphs = None
        if graphs:
            from dwarfstar.backends.triton.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self)

    @classmethod
    def from_model_file(
        cls, model: ModelFile, device: torch.device | str | None = None, qat: bool = True, **kwargs
    ) -> TritonBackend:
        device = torch.device(device) if device is not None else default_device()
        return cls(upload(model.gguf, model.args, device, layer_range=model.layer_range), qat=qat, **kwargs)

    def sample_batch(self, logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
        """One token per row of logits [B, vocab], drawn on the device in one launch; one host sync.

        The kernel ranks each row's TOP_K_CAP best logits; a row it flags (no top-k, and more tokens
        than that may pass min-p) is redrawn by the generic `sample_tokens` at the same counter, which
        costs a second sync only then. Both draw the same Philox uniform from (seed, step) in the same
        order, so the split does not change a seed's tokens. The logprobs of the rows that ask come
        back in the same sync (`read_draws`)."""
        rows = logits.reshape(len(samplers), -1)
        steps = [s.advance() for s in samplers]
        knobs = knob_rows([s.params for s in samplers], [s.seed for s in samplers], steps)
        drawn, overflow = sample_rows(
            rows, knobs.to(rows.device, non_blocking=True), candidates_for([s.params for s in samplers], rows.shape[1])
        )
        host = read_draws(torch.cat([drawn[:, 0], overflow]), rows, drawn[:, 0], samplers)
        return redraw_overflow(rows, samplers, steps, host)

    def forward_batch(
        self,
        token_lists: Sequence[Sequence[int] | torch.Tensor],
        states: Sequence[SequenceState],
        all_logits=False,
        images: Sequence[Sequence[ImageSpan]] | None = None,
    ) -> list[torch.Tensor]:
        """Several sequences in one pass: every weight is read once. A decode step of sequences in one
        KV-cache block runs the batch-native kernels (a graph replay where graphs are on); a prefill
        runs attention per sequence. `forward` comes here too."""
        decode = not (images is not None and any(images)) and all(len(t) == 1 for t in token_lists)
        if self.graphs is not None and decode and self.graphs.serves(states):
            return self.graphs.step([int(torch.as_tensor(t).flatten()[0]) for t in token_lists], states)[0]
        return super().forward_batch(token_lists, states, all_logits, images)

    def decode_sample(
        self, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence[Sampler]
    ) -> list[int]:
        """A decode step, then each state's next token: where graphs serve the states, both in one
        replay (the sampling kernel is captured with the step), else one batched pass and one launch."""
        if self.graphs is not None and self.graphs.serves(states):
            return self.graphs.step(tokens, states, samplers)[1]
        return super().decode_sample(tokens, states, samplers)
