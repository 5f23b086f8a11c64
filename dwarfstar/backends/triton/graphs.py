"""Single-token decode steps replayed from captured CUDA graphs (CUDA and ROCm/HIP graphs).

A decode step launches about 30 kernels per layer; replaying them as one graph removes the CPU
launch cost, which otherwise exceeds the GPU time of a step. The model reads every position-
dependent value on the device (`TritonOps`), so one graph serves every position with the same
launch shape. The shape of a step is: the raw window is full (earlier steps run eagerly), which
compressors emit a row at this position (ratio 4 every 4th token, ratio 128 every 128th), and the
power of two bounding the rows its launches reach (`model.row_bound`). A graph also bakes in the
addresses of the state's arrays, which are its KV-cache slot's and never move (restoring a
snapshot writes into the slot), so a graph is kept per (shape, slot): switching between sessions
replays, never re-captures. The graphs share one memory pool.

A shape is captured only after it ran once eagerly, so every kernel it launches is compiled before
the capture starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dwarfstar.backends.triton.kernels.compressor import emitted
from dwarfstar.backends.triton.model import TritonModel, row_bound
from dwarfstar.model.forward import Batch
from dwarfstar.model.state import SequenceState


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's output buffer, [1, vocab]


class DecodeGraphs:
    def __init__(self, model: TritonModel) -> None:
        self.model = model
        self.tok = torch.zeros(1, dtype=torch.int32, device=model.device)
        self.pos = torch.zeros(1, dtype=torch.int32, device=model.device)
        self.captured: dict[tuple[tuple, tuple[int, int]], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.compiled: set[tuple] = set()
        self.ratios = sorted({r for r in model.args.compress_ratios[: model.args.n_layers] if r})

    def shape(self, state: SequenceState) -> tuple[tuple[int, int], ...]:
        """Per ratio: whether this step emits a row, and the row bound its launches are sized by."""
        end = state.pos + 1
        return tuple((emitted(state.pos, 1, r), row_bound(state.cache, r, end)) for r in self.ratios)

    @torch.inference_mode()
    def step(self, token: int, state: SequenceState) -> torch.Tensor:
        """Logits [1, vocab] after one token; the state advances exactly as the eager path does."""
        model = self.model
        if state.pos < model.args.window:
            return model.forward([token], state)
        shape = self.shape(state)
        if shape not in self.compiled:
            self.compiled.add(shape)
            return model.forward([token], state)
        batch = model.batch([[token]], [state])
        entry = self.captured.get((shape, state.slot))
        if entry is None:
            entry = self.captured[(shape, state.slot)] = self._capture(batch)
        self.tok.fill_(token)
        self.pos.fill_(state.pos)
        entry.graph.replay()
        logits = entry.logits.clone()  # the graph's buffer is overwritten by the next replay
        model.advance(batch)
        state.logits = logits[-1]
        return logits

    def _capture(self, batch: Batch) -> _Captured:
        """Record the device work of a step whose tokens and position come from the static buffers."""
        graph = torch.cuda.CUDAGraph()
        batch.aux.update(tok=self.tok, pos=[self.pos])
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, _ = self.model.compute(batch, all_positions=True)
        return _Captured(graph, logits)
