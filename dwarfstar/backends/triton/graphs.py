"""Decode steps replayed from CUDA graphs (CUDA and ROCm/HIP graphs), one per batch-size bucket.

A decode step launches about 30 kernels per layer; replaying them as one graph removes the CPU
launch cost, which otherwise exceeds the GPU time of a step. A step of B sequences runs the
batch-native kernels (`TritonOps` with `DecodeInputs`): every position and every KV-cache slot is read on
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
The logprobs of the rows whose samplers ask for them are not in the graph: a few launches right
after the replay read its logits and drawn tokens (`sampling.logprob_rows`), and their copy to the
host is waited for by the same sync as the tokens'.

The host side of a step never waits for the device before its replay is queued. The step's inputs
go to the graph's buffers from pinned host memory (`_Staging`, two per bucket used in turn, each
reused only once the device has read it), asynchronously; the drawn tokens come back into pinned
memory the same way. Between queuing the replay and reading the tokens the host does the step's
bookkeeping (positions, token lists, sampler counters) and works out the next step's inputs but its
tokens (`_Plan`: positions, slots, row bounds, the graph to replay, sampler knobs), for the same
sequences one position on; a next step whose sequences, positions, slots and samplers match takes
that plan, any other computes its own. Without samplers a step has no host sync at all, so the
host queues step n+1 while the device runs step n. The tokens themselves cannot be prepared ahead:
step n+1's tokens are step n's draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.backends.triton.kernels.sampling import candidates_for, knob_rows, redraw_overflow, sample_rows
from dwarfstar.backends.triton.model import TritonModel, row_bound
from dwarfstar.backends.triton.step import DecodeInputs, TritonStep
from dwarfstar.model.forward import Batch, Segment
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import GREEDY, Sampler, logprob_rows, record_logprobs

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a graph is captured for; larger batches run eagerly


@dataclass
class _Captured:
    replay: Callable[[], None]
    logits: torch.Tensor  # the graph's output buffer, [bucket, vocab]
    inputs: torch.Tensor  # int32 [3, bucket]: token, position and slot of each row
    knobs: torch.Tensor  # float32 [bucket, 6]: each row's sampling knobs (`sampling.knob_rows`)
    drawn: torch.Tensor  # int32 [2, bucket]: each row's next token, and its full-vocabulary flag


def _plan_key(states: Sequence[SequenceState], samplers: Sequence[Sampler] | None) -> tuple:
    """Everything a step's `_Plan` is computed from (a block's states share one cache)."""
    rows = tuple((s.pos, s.index) for s in states)
    return rows, None if samplers is None else tuple((s.params, s.seed, s.step) for s in samplers)


@dataclass
class _Plan:
    """A decode step's inputs but its tokens, a function of `key` (`_plan_key`) alone."""

    key: tuple
    bucket: int
    graph: tuple[int, tuple[int, ...], int]  # (bucket, row bounds, sampling candidates): its graph
    rows: np.ndarray  # int32 [3, bucket]: row 0 for the tokens, positions, slots (spare rows: the padding slot)
    knobs: torch.Tensor | None  # float32 [bucket, 6] (`sampling.knob_rows`) with samplers


class _Staging:
    """Host buffers a step's inputs leave from and its drawn tokens arrive in: pinned on a GPU, so
    the copies are queued behind the work in flight instead of waiting for it. A buffer is filled
    again only once the copies that read it have run (`sent`)."""

    def __init__(self, bucket: int, pinned: bool) -> None:
        self.rows = torch.zeros(3, bucket, dtype=torch.int32, pin_memory=pinned)
        self.knobs = torch.zeros(bucket, 6, dtype=torch.float32, pin_memory=pinned)
        self.drawn = torch.zeros(2, bucket, dtype=torch.int32, pin_memory=pinned)
        self.sent = torch.cuda.Event() if pinned else None
        self.arrived = torch.cuda.Event() if pinned else None
        self.logprobs: torch.Tensor | None = None  # the last step's, from `fetch`

    def send(self, plan: _Plan, tokens: Sequence[int], entry: _Captured) -> None:
        """Queue the copies of the plan's inputs, with `tokens`, into the graph's buffers."""
        if self.sent is not None:
            self.sent.synchronize()  # this buffer's last copies have read it
        rows = self.rows.numpy()
        rows[:] = plan.rows
        rows[0, : len(tokens)] = tokens
        entry.inputs.copy_(self.rows, non_blocking=True)
        if plan.knobs is not None:
            self.knobs.copy_(plan.knobs)
            entry.knobs.copy_(self.knobs, non_blocking=True)
        if self.sent is not None:
            self.sent.record()

    def fetch(self, drawn: torch.Tensor, logprobs: torch.Tensor | None) -> None:
        """Queue the copies of the replay's drawn tokens and flags, and of the logprobs of the rows
        that ask for them (`sampling.logprob_rows`), back to the host."""
        self.drawn.copy_(drawn, non_blocking=True)
        # from a GPU, a non-blocking copy to the CPU lands in pinned memory it allocates
        self.logprobs = None if logprobs is None else logprobs.to("cpu", non_blocking=True)
        if self.arrived is not None:
            self.arrived.record()

    def fetched(self, n: int) -> tuple[list[int], list[float] | None]:
        """The first `n` rows' tokens, then their flags, and the logprobs fetched with them (None: no
        row asked), once the copies have run (waits for the replay)."""
        if self.arrived is not None:
            self.arrived.synchronize()
        logprobs = None if self.logprobs is None else self.logprobs.reshape(-1).tolist()
        return self.drawn[:, :n].flatten().tolist(), logprobs


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
        self.captured: dict[tuple[int, tuple[int, ...], int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None
        self.pinned = model.device.type == "cuda"
        self._staging: dict[int, list[_Staging]] = {}  # per bucket, the pair its steps use in turn
        self._next: _Plan | None = None  # the last step's sequences one position on
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
        plan, self._next = self._next, None
        if plan is None or plan.key != _plan_key(states, samplers):
            plan = self._plan(states, samplers)
        entry = self.captured.get(plan.graph)
        if entry is None:
            entry = self.captured[plan.graph] = self._capture(*plan.graph)
        pair = self._staging.setdefault(plan.bucket, [_Staging(plan.bucket, self.pinned) for _ in range(2)])
        staging = pair.pop(0)  # the pair in turn: one is filled while the device may still read the other
        pair.append(staging)
        staging.send(plan, tokens, entry)
        steps = None if samplers is None else [s.step for s in samplers]  # advanced once the step has run
        entry.replay()
        n = len(states)
        logits = entry.logits[:n].clone()  # the graph's buffer is overwritten by the next replay
        if samplers is not None:  # the logprobs of the rows that ask: a few launches after the replay
            staging.fetch(entry.drawn, logprob_rows(logits, entry.drawn[0, :n], samplers))
        # host work while the device replays: the bookkeeping, and the next step's inputs but its tokens
        model.advance(batch)
        for state, row in zip(states, logits, strict=True):
            state.logits = row
        if samplers is not None:
            for sampler in samplers:
                sampler.advance()
        self._next = self._plan(states, samplers)
        drawn = None
        if samplers is not None:
            host, logprobs = staging.fetched(n)  # the step's host sync
            if logprobs is not None:
                record_logprobs(samplers, logprobs)
            drawn = redraw_overflow(logits, samplers, steps, host)
        return list(logits.split(1)), drawn

    def graph(
        self, states: Sequence[SequenceState], samplers: Sequence[Sampler] | None = None
    ) -> tuple[int, tuple[int, ...], int]:
        """(bucket, row bounds, sampling candidates): the graph a step of these states replays (`body`'s
        arguments)."""
        return self._plan(states, samplers).graph

    def _plan(self, states: Sequence[SequenceState], samplers: Sequence[Sampler] | None) -> _Plan:
        """The inputs of a step of `states` at their positions, all but the tokens."""
        bucket = next(b for b in BUCKETS if b >= len(states))
        bounds = tuple(max(row_bound(s.cache, r, s.pos + 1) for s in states) for r in self.ratios)
        spare = bucket - len(states)
        rows = np.zeros((3, bucket), dtype=np.int32)  # tokens (the step's own), positions, slots
        rows[1, : len(states)] = [s.pos for s in states]
        rows[2] = [s.index for s in states] + [self.pad.index] * spare
        k, knobs = 0, None
        if samplers is not None:
            params = [s.params for s in samplers] + [GREEDY] * spare
            k = candidates_for(params, self.model.args.vocab_size)
            knobs = knob_rows(
                params, [s.seed for s in samplers] + [0] * spare, [s.step for s in samplers] + [0] * spare
            )
        return _Plan(_plan_key(states, samplers), bucket, (bucket, bounds, k), rows, knobs)

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

    def _padding(self, bucket: int, inputs: torch.Tensor, bounds: tuple[int, ...]) -> Batch[TritonStep]:
        """A step of `bucket` rows whose tokens, positions and slots are read from `inputs`."""
        token = torch.zeros(1, dtype=torch.long)
        batch: Batch[TritonStep] = Batch([Segment(self.pad, token, 0, slice(i, i + 1)) for i in range(bucket)])
        decode = DecodeInputs(inputs[1], inputs[2], dict(zip(self.ratios, bounds, strict=True)))
        batch.prepared = self.model.ops.record(batch, inputs[0], decode)
        return batch
