"""The stress test's backend recorder (`stress.py`): every forward call is a numbered step; the same
token prefix must leave the same logits, bit for bit, wherever and whenever it is computed.

A step keeps, for each state in it: its slot, its position, the tokens it adds and which other slots
share its compressed-row pages. The tokens of every prefix are kept as (the prefix before the call,
the tokens added), so any step's batch can be rebuilt later and run again (`replay`).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dwarfstar.model.forward import forward_then_sample
from dwarfstar.model.state import SequenceState


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def prefix_key(tokens: Sequence[int]) -> str:
    return digest(np.asarray(tokens, dtype=np.int64).tobytes())


@dataclass
class Entry:
    """One state in one step."""

    slot: tuple[int, int]
    pos: int  # tokens before the call
    added: int
    shares_with: list[tuple[int, int]]  # slots holding some of the same row pages
    key: str = ""  # its prefix after the call
    logits: str = ""  # digest of its next-token logits after the call
    top: list[tuple[int, float]] = field(default_factory=list)  # its two best tokens and their logits


@dataclass
class Step:
    index: int
    phase: str  # the harness's phase and request: "concurrent", "alone c1#2"...
    entries: list[Entry]

    def describe(self, target: int | None = None) -> str:
        kind = "decode" if all(e.added == 1 for e in self.entries) else "prefill"
        parts = []
        for i, e in enumerate(self.entries):
            shared = f", pages shared with {e.shares_with}" if e.shares_with else ""
            mark = " <-" if i == target else ""
            parts.append(f"slot {e.slot} pos {e.pos} +{e.added}{shared}{mark}")
        return f"step {self.index} ({self.phase}, {kind} of {len(self.entries)}): " + "; ".join(parts)


@dataclass
class Conflict:
    """A prefix whose logits differ between two steps."""

    key: str
    first: tuple[int, int]  # (step, entry)
    second: tuple[int, int]
    flipped: bool = False  # the best token differs
    gap: float = 0.0  # how far the best token's logit moved (0 when it flipped)


def shares(state: SequenceState) -> list[tuple[int, int]]:
    """The slots of the state's block that hold some of its row pages."""
    out = set()
    for pages in state.cache.pages[state.slot[0]].values():
        own = pages.host[state.index]
        own = own[own >= 0]
        shared = own[pages.holders[own] > 1]
        if shared.size:
            for other in range(pages.host.shape[0]):
                if other != state.index and np.isin(pages.host[other], shared).any():
                    out.add((state.slot[0], other))
    return sorted(out)


class Recorder:
    """Wraps a backend; what the server calls goes through it unchanged."""

    def __init__(self, inner) -> None:
        self.inner, self.args = inner, inner.args
        self.steps: list[Step] = []
        self.seen: dict[str, tuple[int, int]] = {}  # prefix key -> (step, entry) that first computed it
        self.parents: dict[str, tuple[str | None, np.ndarray]] = {}  # prefix key -> (prefix before, tokens added)
        self.conflicts: list[Conflict] = []
        self.phase = "concurrent"
        self.keys_by_phase: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def new_state(self) -> SequenceState:
        return self.inner.new_state()

    def forward(self, tokens, state: SequenceState, all_logits: bool = True, images=None) -> torch.Tensor:
        return self.forward_batch([tokens], [state], all_logits, None if images is None else [images])[0]

    def forward_batch(self, token_lists, states: Sequence[SequenceState], all_logits: bool = False, images=None):
        lists = [[int(t) for t in tokens] for tokens in token_lists]
        before = [(list(s.tokens), s.slot, shares(s)) for s in states]
        out = self.inner.forward_batch(token_lists, states, all_logits, images=images)
        with self._lock:
            self._note(lists, states, before)
        return out

    def sample_batch(self, logits: torch.Tensor, samplers) -> list[int]:
        return self.inner.sample_batch(logits, samplers)

    def decode_sample(self, tokens, states, samplers) -> list[int]:
        return forward_then_sample(self, tokens, states, samplers)  # through this recorder's forward_batch

    def _note(self, lists: list[list[int]], states: Sequence[SequenceState], before) -> None:
        step = Step(len(self.steps), self.phase, [])
        self.steps.append(step)
        for added, state, (prior, slot, shared) in zip(lists, states, before, strict=True):
            if not added:
                continue
            logits = state.logits.detach().float().cpu()
            best = torch.topk(logits, 2)
            entry = Entry(slot, len(prior), len(added), shared, prefix_key(prior + added))
            entry.logits = digest(logits.numpy().tobytes())
            entry.top = [(int(t), float(v)) for v, t in zip(best.values, best.indices, strict=True)]
            step.entries.append(entry)
            parent = prefix_key(prior) if prior else None
            if entry.key not in self.parents:
                if parent is None or parent in self.parents:
                    self.parents[entry.key] = (parent, np.asarray(added, dtype=np.int64))
                else:  # a state the recorder did not see grow (a disk restore): its tokens in full
                    self.parents[entry.key] = (None, np.asarray(prior + added, dtype=np.int64))
            self.keys_by_phase.setdefault(self.phase, []).append(entry.key)
            where = (step.index, len(step.entries) - 1)
            first = self.seen.setdefault(entry.key, where)
            if first != where and self.entry(first).logits != entry.logits:
                (a, x), (b, y) = self.entry(first).top[0], entry.top[0]
                self.conflicts.append(Conflict(entry.key, first, where, a != b, 0.0 if a != b else abs(x - y)))

    def held_mb(self) -> float:
        """What the recorder itself holds (its steps, prefixes and conflicts), so that a soak's RSS
        growth can be told apart from the harness's own: every object reachable from them, counted once."""
        with self._lock:
            roots = [self.steps, self.seen, self.parents, self.conflicts, self.keys_by_phase]
            seen, stack, total = set(), roots, 0
            while stack:
                obj = stack.pop()
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
                total += sys.getsizeof(obj)  # an array that owns its data counts it too
                if isinstance(obj, dict):
                    stack.extend(obj.keys())
                    stack.extend(obj.values())
                elif isinstance(obj, list | tuple):
                    stack.extend(obj)
                elif hasattr(obj, "__dataclass_fields__"):
                    stack.extend(vars(obj).values())
        return total / 2**20

    # -- reading it back -------------------------------------------------------------------------------
    def entry(self, where: tuple[int, int]) -> Entry:
        return self.steps[where[0]].entries[where[1]]

    def tokens(self, key: str) -> list[int]:
        parts = []
        while key is not None:
            key, added = self.parents[key]
            parts.append(added)
        return [int(t) for part in reversed(parts) for t in part]

    def batch_tokens(self, step: Step) -> list[tuple[list[int], list[int]]]:
        """Each entry of the step: (its tokens before the call, the tokens it added)."""
        out = []
        for entry in step.entries:
            tokens = self.tokens(entry.key)
            out.append((tokens[: entry.pos], tokens[entry.pos :]))
        return out

    def dump(self, conflict: Conflict, path: Path, command: str) -> None:
        """What `replay` needs to run both steps of a conflict again."""
        steps = []
        for where in (conflict.first, conflict.second):
            step = self.steps[where[0]]
            steps.append(
                {
                    "step": asdict(step),
                    "target": where[1],
                    "batch": self.batch_tokens(step),
                }
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rerun": command, "steps": steps}))


def replay(backend, chunk: int, path: Path) -> str:
    """Both steps of a dumped conflict run again on fresh states, each state first prefilled alone in
    chunks of `chunk` up to its position: whether each reproduces the logits recorded for its target
    (then the batch and the position decide them), and how far apart the two are."""
    data = json.loads(path.read_text())
    lines, got = [], []
    for item in data["steps"]:
        states = [backend.new_state() for _ in item["batch"]]
        for state, (prior, _) in zip(states, item["batch"], strict=True):
            for lo in range(0, len(prior), chunk):
                backend.forward(prior[lo : min(len(prior), (lo // chunk + 1) * chunk)], state, all_logits=False)
        backend.forward_batch([added for _, added in item["batch"]], states)
        logits = states[item["target"]].logits.detach().float().cpu()
        got.append(logits)
        entry = item["step"]["entries"][item["target"]]
        same = digest(logits.numpy().tobytes()) == entry["logits"]
        step = Step(item["step"]["index"], item["step"]["phase"], [Entry(**e) for e in item["step"]["entries"]])
        lines.append(f"{step.describe(item['target'])}\n  replayed: {'the recorded' if same else 'other'} logits")
    a, b = got
    lines.append(
        f"the two steps' logits: max |difference| {float((a - b).abs().max()):.3g}, "
        f"argmax {int(a.argmax())} and {int(b.argmax())}"
    )
    return "\n".join(lines)
