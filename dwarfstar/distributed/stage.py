"""A worker: one layer range of the model and the KV state of those layers, driven by its coordinator.

`StageWorker.handle` turns one request into one reply and never raises for bad input: a refused
message becomes an ERROR reply with the reason, a session whose position or token-prefix hash is
not the coordinator's becomes MISMATCH (the coordinator replays it). `serve_stage` is the process
loop: wait for a coordinator, register, serve the link until it breaks, then register again.

Speculative decoding: a FORWARD with FLAG_VERIFY is snapshotted and its compressor projections
recorded, so that a TRUNCATE cuts it back to the accepted tokens in place (`speculative.rollback`);
the last stage with a draft keeps what FLAG_DRAFT passes leave it (the final streams for the MTP
block; for DSpark the rows of its target layers' streams, captured in the pass) and drafts from them
(`drafting.StageDrafts`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dwarfstar.backends.registry import entry_of
from dwarfstar.distributed.drafting import StageDrafts, check_target_layers
from dwarfstar.distributed.link import Link, LinkBrokenError, Message
from dwarfstar.distributed.membership import LayerSlice, Registration, connect_store, register
from dwarfstar.distributed.protocol import (
    FLAG_ALL_LOGITS,
    FLAG_DRAFT,
    FLAG_LOGITS,
    FLAG_VERIFY,
    DistError,
    DraftRequest,
    Header,
    Op,
    RegistrationError,
    SegmentRecord,
    Status,
    as_bytes,
    decode_activation,
    encode_activation,
    extend_hash,
    pack_arrays,
    prefix_hash,
    unpack_arrays,
)
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.forward import Transformer
from dwarfstar.model.state import SequenceState, StateSnapshot, TorchStorage
from dwarfstar.speculative.decode import capturing
from dwarfstar.speculative.dspark import DSparkDrafter
from dwarfstar.speculative.mtp import MTPDraft
from dwarfstar.speculative.rollback import CompressorTap, truncate

MAX_SNAPSHOTS = 256  # across sessions; an evicted one is MISSING, which the coordinator replays
IDLE_WAIT_S = 7 * 24 * 3600  # a worker waits this long for its coordinator's next request


def to_backend(t: torch.Tensor, model: Transformer):
    """A float32 host or device tensor as the backend's array (MLX takes numpy)."""
    storage = model.cache.storage
    if isinstance(storage, TorchStorage):
        return t.to(storage.device)
    return storage.from_numpy(t.cpu().numpy())


def settle(model: Transformer, out, batch) -> None:
    """The work of a pass that stops before the head done, as `logits` does it at the head
    (`BackendEntry.settle`: MLX's graph would otherwise grow forever)."""
    entry = entry_of(model)
    if entry is not None:
        entry.settle(out, batch)


def to_torch(a) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a, dtype=np.float32))


def restore_layers(state: SequenceState, layers: range, arrays: dict[str, np.ndarray]) -> None:
    """Write a session's layer tensors (`host_parts` names under `il/`) into a fresh state at state.pos."""
    from_numpy = state.cache.storage.from_numpy
    for il in layers:
        raw = arrays.get(f"{il}/raw")
        if raw is None:
            raise DistError(f"layer tensors for layer {il} are missing")
        state.store_window(il, from_numpy(raw), state.pos)
        for kind in state.cache.compressors[il]:
            for name in (f"{kind}_rows", f"{kind}_kv", f"{kind}_gate"):
                value = arrays.get(f"{il}/{name}")
                if value is None:
                    raise DistError(f"layer {il} lacks its {name} tensor")
                if value.shape[0]:
                    state.write(il, name, from_numpy(value))


@dataclass
class StageSession:
    state: SequenceState
    hash: int


@dataclass
class Verified:
    """A session's last FLAG_VERIFY pass: its request id, tokens and compressor projections."""

    request: int
    count: int
    projections: list


class StageWorker:
    def __init__(self, model: Transformer, layers: LayerSlice, draft: MTPDraft | DSparkDrafter | None = None) -> None:
        """`draft`: the MTP block or the DSpark drafter, on the last stage (it drafts for the coordinator's
        speculators); DSpark's target layers must be the stage's (`drafting.check_target_layers`)."""
        self.model, self.layers = model, layers
        self.sessions: dict[int, StageSession] = {}
        self.snapshots: OrderedDict[tuple[int, int], tuple[StateSnapshot, int]] = OrderedDict()
        self.verified: dict[int, Verified] = {}
        self.drafts = StageDrafts(draft) if draft is not None and layers.holds_head else None
        if self.drafts is not None:
            check_target_layers(self.drafts.layers, layers)

    @property
    def device(self):
        """Where the link's tensors land: the model's device."""
        return getattr(self.model.cache.storage, "device", "cpu")

    @property
    def range(self) -> range:
        return range(self.layers.first, self.layers.last)

    def handle(self, msg: Message) -> Message:
        op = msg.header.op
        try:
            if op == Op.FORWARD:
                return self._forward(msg)
            if op in (Op.SNAPSHOT, Op.RESTORE):
                return self._snapshot(msg) if op == Op.SNAPSHOT else self._restore(msg)
            if op == Op.RESET:
                for seg in msg.segments:
                    self._drop(seg.session)
                return self._reply(msg)
            if op == Op.FORK:
                return self._fork(msg)
            if op == Op.EXPORT:
                return self._export(msg)
            if op == Op.IMPORT:
                return self._import(msg)
            if op == Op.TRUNCATE:
                return self._truncate(msg)
            if op == Op.DRAFT:
                return self._draft(msg)
            return self._reply(msg)  # SHUTDOWN: acknowledged, the loop exits
        except (DwarfStarError, ValueError) as exc:
            return self._reply(msg, Status.ERROR, as_bytes(f"stage {self.layers}: {exc}".encode()))

    # -- operations ------------------------------------------------------------------------------------
    def _sessions_of(self, msg: Message) -> Message | tuple[list[StageSession], list[list[int]]]:
        """A FORWARD's sessions (a new one for a segment that starts one) and each one's tokens; the
        MISMATCH reply instead when this stage holds one out of step."""
        stale = [s.session for s in msg.segments if not self._matches(s)]
        if stale:
            return self._reply(msg, Status.MISMATCH, as_bytes(",".join(map(str, stale)).encode()))
        for seg in msg.segments:
            if seg.start == 0 and seg.session not in self.sessions:
                self.sessions[seg.session] = StageSession(self.model.new_state(), prefix_hash([]))
        ids = msg.tokens.tolist()
        spans, at = [], 0
        for seg in msg.segments:
            spans.append(ids[at : at + seg.count])
            at += seg.count
        return [self.sessions[s.session] for s in msg.segments], spans

    def _advanced(self, msg: Message, sessions: list[StageSession], spans: list[list[int]]) -> None:
        """The sessions' hashes past the pass's tokens, which must be the coordinator's."""
        for seg, session, span in zip(msg.segments, sessions, spans, strict=True):
            session.hash = extend_hash(session.hash, span)
            if session.hash != seg.hash_after:
                raise DistError(f"session {seg.session}: the tokens do not hash to the coordinator's value")

    def _forward(self, msg: Message) -> Message:
        found = self._sessions_of(msg)
        if isinstance(found, Message):
            return found
        sessions, spans = found
        args, h = self.model.args, msg.header
        activation = decode_activation(msg.payload.cpu(), (h.n_rows, args.hc_mult, args.dim), h.bits)
        verify = bool(h.flags & FLAG_VERIFY)
        for seg, session in zip(msg.segments, sessions, strict=True):
            self._forget_verified(seg.session)  # a later pass: the last verify's record is stale
            if verify:
                self._keep_snapshot(seg.session, h.request, session)
        drafts = self.drafts if h.flags & FLAG_DRAFT else None
        started = time.perf_counter()
        # the tap copies every compressor's projections: only for a pass that may be truncated
        with (
            torch.inference_mode(),
            CompressorTap(self.model) if verify else contextlib.nullcontext() as tap,
            capturing(self.model, drafts.layers if drafts is not None else ()) as captured,
        ):
            batch = self.model.batch(spans, [s.state for s in sessions])
            self.model.embed(batch)  # only its per-call preparation (`Ops.prepare`: ids, positions) is used here
            out = self.model.run_layers(to_backend(activation, self.model), batch, self.layers.first, self.layers.last)
            rows = {id(seq.state): seq.rows for seq in batch.seqs}
            for seg, session in zip(msg.segments, sessions, strict=True):
                mine = rows.get(id(session.state))
                if mine is None:
                    continue
                if verify:
                    self.verified[seg.session] = Verified(h.request, seg.count, tap.of(mine))
                if drafts is not None:
                    drafts.hold(seg.session, out[mine], captured, mine)
            if self.layers.holds_head:
                y, _ = self.model.head(out, batch, bool(h.flags & FLAG_ALL_LOGITS))
                payload, flags = self.model.ops.logits(y, batch).float().cpu().contiguous(), FLAG_LOGITS
                payload = payload.view(torch.uint8).reshape(-1)
            else:
                settle(self.model, out, batch)
                payload, flags = encode_activation(to_torch(out), h.bits), 0
            self.model.advance(batch)
        compute_us = int((time.perf_counter() - started) * 1e6)
        self._advanced(msg, sessions, spans)
        return self._reply(msg, payload=payload, flags=flags, compute_us=compute_us)

    def _snapshot(self, msg: Message) -> Message:
        for seg in msg.segments:
            self._keep_snapshot(seg.session, msg.header.request, self._live(seg))
        return self._reply(msg)

    def _keep_snapshot(self, session_id: int, request: int, session: StageSession) -> None:
        self.snapshots[(session_id, request)] = (session.state.snapshot(), session.hash)
        while len(self.snapshots) > MAX_SNAPSHOTS:
            self.snapshots.popitem(last=False)

    def _restore(self, msg: Message) -> Message:
        missing = []
        for seg in msg.segments:
            session, kept = self.sessions.get(seg.session), self.snapshots.get((seg.session, msg.header.request))
            if session is None or kept is None or kept[0].pos != seg.start or not session.state.can_restore(kept[0]):
                missing.append(seg.session)
                continue
            session.state.restore(kept[0])
            session.hash = kept[1]
            self._forget_verified(seg.session)
            if self.drafts is not None:
                self.drafts.cut(seg.session, session.state.pos)
        if missing:
            return self._reply(msg, Status.MISSING, as_bytes(",".join(map(str, missing)).encode()))
        return self._reply(msg)

    def _truncate(self, msg: Message) -> Message:
        """Each session as if only the segment's tokens, the first of its verify pass, had followed
        the snapshot that pass took; MISSING when the snapshot or the pass's record is gone."""
        ids, at, missing, started = msg.tokens.tolist(), 0, [], time.perf_counter()
        for seg in msg.segments:
            kept, at = ids[at : at + seg.count], at + seg.count
            session, snap = self.sessions.get(seg.session), self.snapshots.get((seg.session, msg.header.request))
            done = self.verified.get(seg.session)
            if (
                session is None
                or snap is None
                or done is None
                or done.request != msg.header.request
                or snap[0].pos != seg.start
                or snap[1] != seg.hash_before
                or session.state.pos != seg.start + done.count
                or not session.state.can_restore(snap[0])
            ):
                missing.append(seg.session)
                continue
            if not 0 < seg.count <= done.count or extend_hash(seg.hash_before, kept) != seg.hash_after:
                raise DistError(f"session {seg.session}: the kept tokens are not a prefix of the verified ones")
            with torch.inference_mode():
                truncate(self.model, session.state, snap[0], done.projections, kept, None, self.range)
            session.hash = seg.hash_after
            self._forget_verified(seg.session)
            if self.drafts is not None:
                self.drafts.cut(seg.session, session.state.pos)
        if missing:
            return self._reply(msg, Status.MISSING, as_bytes(",".join(map(str, missing)).encode()))
        return self._reply(msg, compute_us=int((time.perf_counter() - started) * 1e6))

    def _draft(self, msg: Message) -> Message:
        if self.drafts is None:
            raise DistError(
                "this stage has no MTP block or DSpark drafter to draft with (start the last worker with "
                "--mtp FILE or --dspark FILE)"
            )
        (seg,) = msg.segments
        session = self.sessions.get(seg.session)
        done = self.drafts.handle(
            seg.session, None if session is None else session.state, DraftRequest.unpack(msg.payload)
        )
        if done is None:
            return self._reply(msg, Status.MISSING, as_bytes(f"no draft track for session {seg.session}".encode()))
        drafts, logits, compute_us = done
        payload = None if logits is None else logits.view(torch.uint8).reshape(-1)
        tokens = torch.tensor(drafts, dtype=torch.int64)
        return self._reply(
            msg, payload=payload, flags=FLAG_LOGITS if logits is not None else 0, compute_us=compute_us, tokens=tokens
        )

    def _fork(self, msg: Message) -> Message:
        source, twin = msg.segments
        session = self._live(source)
        self.sessions[twin.session] = StageSession(copy.deepcopy(session.state), session.hash)
        return self._reply(msg)

    def _export(self, msg: Message) -> Message:
        (seg,) = msg.segments
        state = self._live(seg).state
        arrays = {f"{il}/{name}": a for il in self.range for name, a in state.host_parts(il).items()}
        return self._reply(msg, payload=pack_arrays(arrays))

    def _import(self, msg: Message) -> Message:
        (seg,) = msg.segments
        tokens = msg.tokens.tolist()
        if seg.start != 0 or len(tokens) != seg.count or prefix_hash(tokens) != seg.hash_after:
            raise DistError(f"session {seg.session}: imported tokens do not match the header")
        self._drop(seg.session)
        state = self.model.new_state()
        if seg.count > state.cache.ctx:
            raise DistError(f"an imported session of {seg.count} tokens exceeds this stage's context {state.cache.ctx}")
        state.pos, state.tokens = seg.count, tokens
        restore_layers(state, self.range, unpack_arrays(msg.payload))
        self.sessions[seg.session] = StageSession(state, seg.hash_after)
        return self._reply(msg)

    # -- helpers ---------------------------------------------------------------------------------------
    def _matches(self, seg: SegmentRecord) -> bool:
        session = self.sessions.get(seg.session)
        if session is None:
            return seg.start == 0 and seg.hash_before == prefix_hash([])
        return session.state.pos == seg.start and session.hash == seg.hash_before

    def _live(self, seg: SegmentRecord) -> StageSession:
        session = self.sessions.get(seg.session)
        if session is None or session.state.pos != seg.start or session.hash != seg.hash_before:
            raise DistError(f"session {seg.session} is not at position {seg.start} here")
        return session

    def _forget_verified(self, session: int) -> None:
        """A verify pass's record and snapshot, once truncated, restored or passed: each step's would
        otherwise fill the snapshot store (a snapshot copies the stage's raw rings and frontiers)."""
        done = self.verified.pop(session, None)
        if done is not None:
            self.snapshots.pop((session, done.request), None)

    def _drop(self, session: int) -> None:
        self.sessions.pop(session, None)
        self.verified.pop(session, None)
        if self.drafts is not None:
            self.drafts.drop(session)
        for key in [k for k in self.snapshots if k[0] == session]:
            del self.snapshots[key]

    def _reply(
        self,
        msg: Message,
        status: Status = Status.OK,
        payload: torch.Tensor | None = None,
        flags: int = 0,
        compute_us: int = 0,
        tokens: torch.Tensor | None = None,
    ) -> Message:
        payload = torch.empty(0, dtype=torch.uint8) if payload is None else payload
        tokens = torch.empty(0, dtype=torch.int64) if tokens is None else tokens
        header = Header(
            msg.header.op,
            msg.header.request,
            n_rows=tokens.numel(),
            payload_bytes=payload.numel(),
            bits=msg.header.bits,
            flags=flags,
            status=status,
            compute_us=compute_us,
        )
        return Message(header, tokens=tokens, payload=payload)


@dataclass
class WorkerOptions:
    host: str
    port: int
    bind: str  # the one address this worker's gloo pair listens on
    secret: str
    wait_s: float  # how long to wait for a coordinator to answer, each time
    data_backend: str = "gloo"


def serve_stage(
    new_stage: Callable[[], StageWorker],
    registration: Registration,
    options: WorkerOptions,
    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True),
) -> None:
    """Serve coordinators until SHUTDOWN, each link with a fresh stage of `new_stage` (V4's or V4.1's);
    a refused registration ends with its reason as an error."""
    while True:
        store = connect_store(options.host, options.port, options.wait_s)
        try:
            worker = register(store, registration, options.secret, options.wait_s)
        except RegistrationError:
            raise  # a refusal is final: the same registration would be refused again
        except (DistError, RuntimeError) as exc:  # the coordinator went away meanwhile
            log(f"registration failed ({exc}); retrying")
            continue
        stage = new_stage()
        try:
            link = Link(store, f"link/{worker}", 1, options.bind, IDLE_WAIT_S, options.data_backend, stage.device)
            log(f"worker {worker}: serving layers {stage.layers} for {options.host}:{options.port}")
            serve_link(stage, link)
            return
        except LinkBrokenError as exc:
            log(f"worker {worker}: {exc}; waiting for a coordinator again")


def serve_link(stage: StageWorker, link) -> None:
    """Answer the link's requests until SHUTDOWN (a broken link raises)."""
    while True:
        msg = link.recv()
        link.send(stage.handle(msg))
        if msg.header.op == Op.SHUTDOWN:
            return
