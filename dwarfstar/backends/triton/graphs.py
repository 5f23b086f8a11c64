"""Decode steps replayed from CUDA graphs (CUDA and ROCm/HIP graphs), one per batch-size bucket.

A decode step launches about 30 kernels per layer; replaying them as one graph removes the CPU
launch cost, which otherwise exceeds the GPU time of a step. A step of B sequences runs the
batch-native kernels (`TritonOps` with `slots`): every position and every KV-cache slot is read on
the device from the step's input buffer, so nothing a graph bakes in depends on which sequences it
serves or where they are. A graph is captured per (bucket, row bounds): the bucket is B rounded up
to a power of two, its spare rows run on a padding slot of the cache; the row bounds
(`model.row_bound`, the powers of two sizing the indexer and attention grids) change only when a
sequence crosses one. Switching sessions, restoring snapshots and moving to other positions replay
the same graphs.

Before a graph is captured its step runs once eagerly on the padding slot alone, so every kernel
variant it launches is compiled before the capture starts, and no sequence's state is touched.
The graphs share one memory pool.

A step given the sequences' samplers also draws each one's next token inside the graph
(`kernels.sampling`): the knobs are another input buffer, so one graph serves any mix of requests,
and the step's one host sync reads the tokens. Such graphs are captured apart from the
logits-only ones, by whether every row is greedy (the argmax) or not (ranking TOP_K_CAP candidates).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dwarfstar.backends.triton.kernels.sampling import candidates_for, knob_rows, redraw_overflow, sample_rows
from dwarfstar.backends.triton.model import TritonModel, row_bound
from dwarfstar.model.forward import Batch, Segment
from dwarfstar.model.state import SequenceState
from dwarfstar.session.sampling import GREEDY, Sampler

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a graph is captured for; larger batches run eagerly


@dataclass
class _Captured:
    replay: Callable[[], None]
    logits: torch.Tensor  # the graph's output buffer, [bucket, vocab]
    inputs: torch.Tensor  # int32 [3, bucket]: token, position and slot of each row
    knobs: torch.Tensor  # float32 [bucket, 6]: each row's sampling knobs (`sampling.knob_rows`)
    drawn: torch.Tensor  # int32 [2, bucket]: each row's next token, and its full-vocabulary flag


def capture(run: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Record `run`'s device work as a CUDA graph: its replay, and the output buffer it refills."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph.replay, out


class DecodeGraphs:
    def __init__(self, model: TritonModel) -> None:
        self.model = model
        # the slot that takes a bucket's spare rows: zeroed, so padding computes finite values; it
        # stays at position 0, so its steps write only row 0 of each ratio, in a page of its own
        self.pad = model.new_state()
        self.pad.reserve(0, 1)
        for il in range(model.args.n_layers):
            for name, array in self.pad.parts(il).items():
                if not name.endswith("_rows"):
                    array[self.pad.index].zero_()
        for ratio, compressors in model.cache.ratios.items():
            page = int(self.pad.row_pages(ratio).host[self.pad.index, 0])
            for il, kind in compressors:
                self.pad.parts(il)[f"{kind}_rows"][page].zero_()
        self.captured: dict[tuple[int, tuple[int, ...]], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.ratios = sorted({r for r in model.args.compress_ratios[: model.args.n_layers] if r})

    def serves(self, states: Sequence[SequenceState]) -> bool:
        """Whether a decode step of these states can be replayed: all in the padding slot's block."""
        return len(states) <= BUCKETS[-1] and all(s.block == self.pad.block for s in states)

    @torch.inference_mode()
    def step(
        self, tokens: Sequence[int], states: Sequence[SequenceState], samplers: Sequence[Sampler] | None = None
    ) -> tuple[list[torch.Tensor], list[int] | None]:
        """Each sequence's logits [1, vocab] after its one token, and with `samplers` each one's next
        token drawn in the same replay (one host sync); the states advance exactly as the eager path
        advances them."""
        model = self.model
        batch = model.batch([[t] for t in tokens], states)  # validated before any device work
        bucket = next(b for b in BUCKETS if b >= len(states))
        bounds = tuple(max(row_bound(s.cache, r, s.pos + 1) for s in states) for r in self.ratios)
        k = 0 if samplers is None else candidates_for([s.params for s in samplers], model.args.vocab_size)
        entry = self.captured.get((bucket, bounds, k))
        if entry is None:
            entry = self.captured[(bucket, bounds, k)] = self._capture(bucket, bounds, k)
        spare = bucket - len(states)
        rows = [list(tokens), [s.pos for s in states], [s.index for s in states]]
        host = torch.tensor([r + [fill] * spare for r, fill in zip(rows, (0, 0, self.pad.index), strict=True)])
        entry.inputs.copy_(host.to(torch.int32))  # one copy to the device per step
        if samplers is not None:
            steps = [s.step for s in samplers]  # advanced once the step has run
            params = [s.params for s in samplers] + [GREEDY] * spare
            knobs = knob_rows(params, [s.seed for s in samplers] + [0] * spare, steps + [0] * spare)
            entry.knobs.copy_(knobs, non_blocking=True)
        entry.replay()
        logits = entry.logits[: len(states)].clone()  # the graph's buffer is overwritten by the next replay
        model.advance(batch)
        for state, row in zip(states, logits, strict=True):
            state.logits = row
        drawn = None
        if samplers is not None:
            for sampler in samplers:
                sampler.advance()
            n = len(states)
            host_drawn = torch.cat([entry.drawn[0, :n], entry.drawn[1, :n]]).tolist()  # the step's host sync
            drawn = redraw_overflow(logits, samplers, steps, host_drawn)
        return list(logits.split(1)), drawn

    def _capture(self, bucket: int, bounds: tuple[int, ...], k: int) -> _Captured:
        run, inputs, knobs, drawn = self.body(bucket, bounds, k)
        run()  # eagerly first, on the padding slot: compiles every kernel the graph will launch
        replay, logits = capture(run, self.pool)
        return _Captured(replay, logits, inputs, knobs, drawn)

    def body(
        self, bucket: int, bounds: tuple[int, ...], k: int
    ) -> tuple[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device work of one decode step of `bucket` rows (what a graph captures, and what
        `dwarfstar bench gpu-plan` counts): (run, its input, knob and drawn-token buffers); `run`
        returns the logits, and with k > 0 also draws each row's token into `drawn`."""
        device = self.model.device
        inputs = torch.zeros(3, bucket, dtype=torch.int32, device=device)
        inputs[2] = self.pad.index
        knobs = knob_rows([GREEDY] * bucket, [0] * bucket, [0] * bucket).to(device)
        drawn = torch.zeros(2, bucket, dtype=torch.int32, device=device)

        def run() -> torch.Tensor:
            logits = self.model.compute(self._padding(bucket, inputs, bounds), all_positions=True)[0]
            if k:
                sample_rows(logits, knobs, k, out=(drawn[0].view(bucket, 1), drawn[1]))
            return logits

        return run, inputs, knobs, drawn

    def _padding(self, bucket: int, inputs: torch.Tensor, bounds: tuple[int, ...]) -> Batch:
        """A step of `bucket` rows whose tokens, positions and slots are read from `inputs`."""
        token = torch.zeros(1, dtype=torch.long)
        batch = Batch([Segment(self.pad, token, 0, slice(i, i + 1)) for i in range(bucket)])
        bound = dict(zip(self.ratios, bounds, strict=True))
        batch.aux.update(tok=inputs[0], pos=inputs[1], slots=inputs[2], row_bound=bound)
        return batch
