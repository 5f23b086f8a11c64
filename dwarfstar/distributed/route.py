"""The coordinator's side of a route: its own first layers, the workers' links, and a `Backend`.

`RouteBackend` is what the session layer drives (`Session`, `decode_batch`, `run`, `serve`), with
`RouteState`s in place of plain states. One forward runs the coordinator's layers, then sends the
activation to each worker in layer order and relays the reply to the next (a star: bytes are
relayed as they came, so an 8-bit activation is not re-encoded by the coordinator); the last stage
answers with logits. A worker that reports a session out of step (MISMATCH, MISSING) makes the
coordinator replay that session's tokens through the whole route; a worker that disconnects fails
the request in flight, is dropped, and marks every live session for replay once the route is whole.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dwarfstar.distributed.link import Link, LinkBrokenError, Message
from dwarfstar.distributed.membership import LayerSlice, Registration, Rendezvous
from dwarfstar.distributed.protocol import (
    FLAG_ALL_LOGITS,
    FLAG_LOGITS,
    PROTOCOL,
    DistError,
    DraftRequest,
    Header,
    Op,
    RegistrationError,
    RouteIncompleteError,
    SegmentRecord,
    Status,
    encode_activation,
    extend_hash,
    pack_arrays,
    prefix_hash,
    unpack_arrays,
)
from dwarfstar.distributed.route_state import RouteSnapshot, RouteState
from dwarfstar.distributed.stage import settle, to_torch
from dwarfstar.model.forward import Batch, Transformer
from dwarfstar.model.state import SequenceState, TorchStorage

WATCH_INTERVAL_S = 0.5  # how often an idle coordinator looks for new registrations


@dataclass
class RouteOptions:
    bits: int = 32  # activation width on the wire: 32 (bit-exact), 16 or 8
    prefill_chunk: int = 4096  # tokens per route pass of a long prefill
    prefill_window: int = 1  # prefill chunks in flight along the route (1: one pass at a time)
    timeout_s: float = 600.0  # a stage that takes longer for one message is dropped
    debug: bool = False  # print each pass's per-hop telemetry on stderr
    data_backend: str = "gloo"


@dataclass
class Hop:
    """One stage's part of a pass; the coordinator's own hop has only compute."""

    layers: str
    who: str
    tokens: int
    compute_ms: float
    wait_ms: float = 0.0  # waiting for the reply, beyond the stage's compute: transfer and queueing
    send_ms: float = 0.0
    bytes: int = 0  # sent and received

    def line(self) -> str:
        extra = (
            f" wait {self.wait_ms:.2f} ms send {self.send_ms:.2f} ms bytes {self.bytes}"
            if self.who != "coordinator"
            else ""
        )
        return f"[dist] layers {self.layers} ({self.who}) tokens {self.tokens} compute {self.compute_ms:.2f} ms{extra}"


@dataclass
class RemoteStage:
    layers: LayerSlice
    worker: int
    host: str
    link: Link = field(repr=False)
    mtp: bool = False  # it holds the head and a draft (it drafts)
    dspark: bool = False  # that draft is DSpark's (else the MTP block)


def _locked(method: Callable) -> Callable:
    """Run under the route's lock: the registration watcher and the callers share the links."""

    @functools.wraps(method)
    def wrapper(self: Route, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class ReplayNeeded(Exception):
    """A stage does not hold a session as the coordinator does (internal: the route replays it)."""


class Route:
    def __init__(
        self,
        local: Transformer,
        local_layers: LayerSlice,
        rendezvous: Rendezvous | None,
        identity: tuple[str, str],
        ctx: int,
        options: RouteOptions,
        mtp: bool = False,
    ) -> None:
        """`mtp`: the coordinator drafts with MTP, so the last stage must hold the block."""
        if local_layers.first != 0 or local_layers.holds_head:
            raise DistError(f"the coordinator holds the first layers and not the head, not {local_layers}")
        self.local, self.local_layers, self.rendezvous = local, local_layers, rendezvous
        self.identity, self.ctx, self.options, self.mtp = identity, ctx, options, mtp
        self.stages: list[RemoteStage] = []
        self.live: weakref.WeakSet[RouteState] = weakref.WeakSet()
        self.released: list[int] = []  # session ids of dropped states, reset on the workers at the next call
        self.hops: list[Hop] = []  # the last pass's telemetry
        self.replays = 0  # sessions replayed through the route (after a mismatch or a lost worker)
        self.mismatches = 0  # passes a stage refused because it held a session out of step
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self._requests = itertools.count(1)
        self._closed = threading.Event()
        if rendezvous is not None:
            threading.Thread(target=self._watch, name="dist-registrations", daemon=True).start()

    def new_session_id(self) -> int:
        return next(self._ids)

    # -- membership ----------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            if self.lock.acquire(blocking=False):
                try:
                    self.accept_arrivals()
                except Exception as exc:  # noqa: BLE001 - the watcher must outlive a bad store reply
                    self.log(f"[dist] registration check failed: {exc}")
                finally:
                    self.lock.release()

    def accept_arrivals(self) -> None:
        if self.rendezvous is None:  # an MLX ring: its members registered once, at the start
            return
        for worker, reg in self.rendezvous.arrivals():
            try:
                if isinstance(reg, RegistrationError):
                    raise reg
                self.rendezvous.check_secret(worker, reg)
                self.admit(worker, reg, functools.partial(self._open_store_link, worker))
            except RegistrationError as exc:
                self.rendezvous.answer(worker, str(exc))
                self.log(f"[dist] refused worker {worker}: {exc}")

    def _open_store_link(self, worker: int) -> Link:
        self.rendezvous.answer(worker, None)
        store, host = self.rendezvous.store, self.rendezvous.host
        timeout, backend = self.options.timeout_s, self.options.data_backend
        return Link(store, f"link/{worker}", 0, host, timeout, backend, self.local_device)

    def admit(self, worker: int, reg: Registration, open_link: Callable[[], Link]) -> None:
        """Check a registration against the route (refusals raise `RegistrationError`), then open its link."""
        model_id, quant = self.identity
        if reg.protocol != PROTOCOL:
            raise RegistrationError(
                f"worker {worker} at {reg.host} speaks stage protocol {reg.protocol}, this coordinator {PROTOCOL}: "
                "run the same DwarfStar version on every machine"
            )
        if reg.model_id != model_id or reg.quant != quant:
            raise RegistrationError(
                f"worker {worker} at {reg.host} serves another model (id {reg.model_id}, {reg.quant}); "
                f"the coordinator's is {model_id} ({quant})"
            )
        n = self.local.args.n_layers
        if not 0 <= reg.first < reg.last <= n:
            raise RegistrationError(f"worker {worker} asks for layers {reg.first}:{reg.last} outside 0:{n}")
        layers = LayerSlice(reg.first, reg.last, n)
        if self.mtp and layers.holds_head and not reg.mtp:
            raise RegistrationError(
                f"worker {worker} at {reg.host} serves the output head (layers {layers}) without an MTP block "
                "or a DSpark drafter, and this coordinator drafts: start that worker with the coordinator's "
                "--mtp FILE (or --mtp-draft N for the model's own block) or --dspark FILE"
            )
        if reg.ctx < self.ctx:
            raise RegistrationError(f"worker {worker} holds a context of {reg.ctx}, the route needs {self.ctx}")
        owners = [("the coordinator", self.local_layers)] + [(f"worker {s.worker}", s.layers) for s in self.stages]
        for who, held in owners:
            if held.first < layers.last and layers.first < held.last and held != layers:
                raise RegistrationError(f"worker {worker}'s layers {layers} overlap {who}'s {held}")
        replaced = [s for s in self.stages if s.layers == layers]
        if any(who == "the coordinator" and held == layers for who, held in owners):
            raise RegistrationError(f"worker {worker}'s layers {layers} are the coordinator's")
        link = open_link()
        for old in replaced:  # a restarted worker for the same layers takes over; its sessions are gone
            self._drop(old, f"replaced by worker {worker}")
        drafts = reg.mtp and layers.holds_head
        stage = RemoteStage(layers, worker, reg.host, link, drafts, drafts and reg.dspark)
        self.stages = sorted([*self.stages, stage], key=lambda s: s.layers.first)
        self._mark_all_dirty()
        draft = f" and the {'DSpark' if stage.dspark else 'MTP'} draft" if stage.mtp else ""
        self.log(f"[dist] worker {worker} at {reg.host} serves layers {layers}{draft}")

    @property
    def local_device(self) -> torch.device | str:
        storage = self.local.cache.storage
        return storage.device if isinstance(storage, TorchStorage) else "cpu"

    def gaps(self) -> list[str]:
        """The layer ranges no live stage holds."""
        out, at = [], self.local_layers.last
        for stage in self.stages:
            if stage.layers.first > at:
                out.append(str(LayerSlice(at, stage.layers.first, self.local_layers.n_layers)))
            at = max(at, stage.layers.last)
        if at < self.local_layers.n_layers:
            out.append(str(LayerSlice(at, self.local_layers.n_layers, self.local_layers.n_layers)))
        return out

    def check_complete(self) -> None:
        self.accept_arrivals()
        missing = self.gaps()
        if missing:
            held = ", ".join(
                [f"{self.local_layers} coordinator"] + [f"{s.layers} worker {s.worker}" for s in self.stages]
            )
            raise RouteIncompleteError(
                f"the route is incomplete: layers {', '.join(missing)} have no worker (live: {held}); "
                "start a worker for them with --dist-role worker --layers A:B"
            )

    def wait_complete(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock:
                try:
                    self.check_complete()
                    return
                except RouteIncompleteError:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(WATCH_INTERVAL_S / 5)

    def _drop(self, stage: RemoteStage, why: str) -> None:
        if stage in self.stages:
            self.stages.remove(stage)
            self._mark_all_dirty()
            self.log(f"[dist] dropped worker {stage.worker} (layers {stage.layers}): {why}")

    def _mark_all_dirty(self) -> None:
        for state in list(self.live):
            state.dirty = True

    def close(self) -> None:
        """Tell the workers to exit and stop watching for registrations (the store stops listening
        when the route is dropped)."""
        self._closed.set()
        with self.lock:
            for stage in list(self.stages):
                try:
                    stage.link.request(Message(Header(Op.SHUTDOWN)), min(self.options.timeout_s, 10.0))
                except (LinkBrokenError, DistError):
                    pass
            self.stages.clear()

    # -- one message to one stage ------------------------------------------------------------------------
    def _call(self, stage: RemoteStage, msg: Message) -> Message:
        try:
            reply = stage.link.request(msg, self.options.timeout_s)
        except LinkBrokenError as exc:
            self._drop(stage, str(exc))
            raise RouteIncompleteError(
                f"the worker for layers {stage.layers} ({stage.host}) disconnected during the request: {exc}; "
                "requests fail until a worker for those layers registers again"
            ) from None
        if reply.header.status == Status.ERROR:
            raise DistError(bytes(reply.payload.numpy()).decode(errors="replace"))
        if reply.header.status in (Status.MISMATCH, Status.MISSING):
            raise ReplayNeeded(f"layers {stage.layers}: {reply.header.status.name.lower()}")
        return reply

    def _broadcast(self, op: Op, segments: list[SegmentRecord], request: int = 0) -> list[Message]:
        header = Header(op, request or next(self._requests), n_segments=len(segments))
        return [self._call(stage, Message(header, segments)) for stage in list(self.stages)]

    @staticmethod
    def _record(state: RouteState, count: int = 0) -> SegmentRecord:
        h = state.token_hash()
        return SegmentRecord(state.session_id, state.pos, count, h, h)

    # -- the forward pass --------------------------------------------------------------------------------
    def first_hop(self, batch: Batch, all_logits: bool, flags: int = 0, request: int = 0) -> tuple[Message, Hop]:
        """The coordinator's layers over a validated batch, as the message to the first worker
        (`flags`: FLAG_DRAFT, FLAG_VERIFY; `request`: the id a FLAG_VERIFY pass's snapshots go under)."""
        segments = []
        for seq in batch.seqs:
            before = seq.state.token_hash()
            after = extend_hash(before, seq.tokens.tolist())
            segments.append(SegmentRecord(seq.state.session_id, seq.start, seq.length, before, after))
        tokens = torch.cat([seq.tokens for seq in batch.seqs])
        started = time.perf_counter()
        h = self.local.run_layers(self.local.embed(batch), batch, 0, self.local_layers.last)
        settle(self.local, h, batch)
        payload = encode_activation(to_torch(h), self.options.bits)
        hop = Hop(str(self.local_layers), "coordinator", batch.n_rows, (time.perf_counter() - started) * 1e3)
        flags |= FLAG_ALL_LOGITS if all_logits else 0
        request = request or next(self._requests)
        header = Header(Op.FORWARD, request, len(segments), batch.n_rows, payload.numel(), self.options.bits, flags)
        return Message(header, segments, tokens, payload), hop

    def run(self, batch: Batch, all_logits: bool, flags: int = 0, request: int = 0) -> torch.Tensor:
        """Logits [rows, vocab] of a validated batch of RouteStates, through every stage; not advanced."""
        msg, hop = self.first_hop(batch, all_logits, flags, request)
        return self.through_stages(msg, [hop], batch.n_rows if all_logits else len(batch.seqs))

    def through_stages(self, msg: Message, hops: list[Hop], rows: int) -> torch.Tensor:
        """The logits [rows, vocab] the last stage answers a FORWARD with, relayed through every stage
        after the coordinator's (`hops`: the coordinator's, the others' appended)."""
        for stage in list(self.stages):
            reply, hop = self.relay(stage, msg)
            hops.append(hop)
            if reply.header.flags & FLAG_LOGITS:
                self._report(hops)
                return self.logits_of(reply, rows)
            msg = self.next_message(msg, reply)
        raise DistError("no stage of the route holds the output head")

    def relay(self, stage: RemoteStage, msg: Message) -> tuple[Message, Hop]:
        """One stage's reply to a FORWARD, and its telemetry."""
        link, before_bytes = stage.link, stage.link.bytes_sent + stage.link.bytes_received
        t0 = time.perf_counter()
        reply = self._call(stage, msg)
        t_sent, t_done = link.last_send_done, time.perf_counter()
        compute_ms = reply.header.compute_us / 1e3
        hop = Hop(
            str(stage.layers),
            f"worker {stage.worker}",
            msg.header.n_rows,
            compute_ms,
            max(0.0, (t_done - t_sent) * 1e3 - compute_ms),
            (t_sent - t0) * 1e3,
            link.bytes_sent + link.bytes_received - before_bytes,
        )
        return reply, hop

    @staticmethod
    def next_message(msg: Message, reply: Message) -> Message:
        """The FORWARD for the next stage: the same spans, the reply's activation bytes as they came."""
        return Message(
            replace(msg.header, payload_bytes=reply.payload.numel()), msg.segments, msg.tokens, reply.payload
        )

    def logits_of(self, reply: Message, rows: int) -> torch.Tensor:
        return reply.payload.cpu().view(torch.float32).reshape(rows, self.local.args.vocab_size)

    def _report(self, hops: list[Hop]) -> None:
        self.hops = hops
        if self.options.debug:
            for hop in hops:
                self.log(hop.line())

    def forward(
        self, spans: list[torch.Tensor], states: list[RouteState], all_logits: bool, flags: int = 0, request: int = 0
    ) -> list[torch.Tensor]:
        """Run and advance sequences (each given tokens), replaying them once if a stage has them out of step."""
        batch = self.local.batch(spans, states)
        try:
            logits = self.run(batch, all_logits, flags, request)
        except ReplayNeeded as why:
            self.mismatches += 1
            self.log(f"[dist] {why}: replaying {len(states)} session(s)")
            for state in states:
                self.rebuild(state)
            batch = self.local.batch(spans, states)  # a fresh call: the backend's per-call preparation again
            try:
                logits = self.run(batch, all_logits, flags, request)
            except ReplayNeeded as again:
                raise DistError(f"a stage still disagrees after replaying the sessions: {again}") from None
        self.local.advance(batch)
        device, out = self.local_device, []
        for i, seq in enumerate(batch.seqs):
            mine = (logits[seq.rows] if all_logits else logits[i : i + 1]).to(device)
            seq.state.logits = mine[-1].clone()
            out.append(mine)
        return out

    # -- keeping the workers' copies in step ---------------------------------------------------------------
    @_locked
    def sync(self, state: RouteState) -> None:
        """Before a state is used: reset released sessions, send a pending import, or replay a lost session."""
        if self.released:
            dropped, self.released[:] = list(self.released), []
            self._broadcast(Op.RESET, [SegmentRecord(s, 0, 0, 0, 0) for s in dropped])
        if state.pending:
            self._import(state)
        elif state.dirty:
            self.rebuild(state)

    def rebuild(self, state: RouteState) -> None:
        """Replay the state's tokens through every stage from an empty state."""
        tokens = list(state.tokens)
        self.replays += 1
        self._broadcast(Op.RESET, [SegmentRecord(state.session_id, 0, 0, 0, 0)])
        storage = state.cache.storage
        for il in range(self.local_layers.last):
            for kind, spec in state.cache.compressors[il].items():
                SequenceState.write(state, il, f"{kind}_kv", storage.full(spec.frontier_shape, 0.0))
                SequenceState.write(state, il, f"{kind}_gate", storage.full(spec.frontier_shape, float("-inf")))
        state.pos, state.tokens, state.dirty, state.gathered = 0, [], False, None
        state.reset_hash()
        step = self.options.prefill_chunk
        for at in range(0, len(tokens), step):
            batch = self.local.batch([tokens[at : at + step]], [state])
            try:
                logits = self.run(batch, all_logits=False)
            except ReplayNeeded as why:
                raise DistError(f"replaying session {state.session_id} failed: {why}") from None
            self.local.advance(batch)
            state.logits = logits[0].to(self.local_device).clone()

    @_locked
    def snapshot(self, state: RouteState) -> int:
        request = next(self._requests)
        self._broadcast(Op.SNAPSHOT, [self._record(state)], request)
        return request

    def next_request(self) -> int:
        return next(self._requests)

    @_locked
    def restore(self, state: RouteState, snap: RouteSnapshot) -> None:
        state.rewound_to(snap)
        try:
            self._broadcast(Op.RESTORE, [self._record(state)], snap.request)
        except ReplayNeeded:
            self.rebuild(state)

    @_locked
    def truncate(self, state: RouteState, snap: RouteSnapshot, kept: list[int]) -> None:
        """Every worker's layers of the state cut back to `kept`, the first tokens of the FLAG_VERIFY
        pass under the snapshot's request id (the coordinator's own layers are cut already). A worker
        that lost the pass's record marks the state for replay. --debug prints a hop per worker."""
        before = snap.token_hash
        record = SegmentRecord(state.session_id, snap.pos, len(kept), before, extend_hash(before, kept))
        header = Header(Op.TRUNCATE, snap.request, 1, len(kept))
        msg = Message(header, [record], torch.tensor(kept, dtype=torch.int64))
        hops = []
        for stage in list(self.stages):
            try:
                _, hop = self.relay(stage, msg)
            except ReplayNeeded as why:
                self.log(f"[dist] truncating session {state.session_id}: {why}; it will be replayed")
                state.dirty = True
                return
            hops.append(replace(hop, layers=f"{stage.layers} truncate"))
        self._report(hops)

    @_locked
    def drafting_stage(self) -> RemoteStage:
        """The route's last stage, which must be there and hold a draft (the MTP block or DSpark's)."""
        self.check_complete()
        stage = self.stages[-1]
        if not stage.mtp:
            raise DistError(
                f"the route's last stage (worker {stage.worker} at {stage.host}, layers {stage.layers}) has no "
                "MTP block: start it with --mtp FILE (or --mtp-draft N for the model's own block), or with "
                "--dspark FILE to draft with DSpark"
            )
        return stage

    @_locked
    def draft(self, state: RouteState, request: DraftRequest) -> Message:
        """One DRAFT to the last stage (raises ReplayNeeded when it holds no such track); --debug
        prints its hop, its tokens the drafts proposed."""
        stage = self.drafting_stage()
        kind = "dspark" if stage.dspark else "mtp"
        payload = request.pack()
        header = Header(Op.DRAFT, next(self._requests), 1, payload_bytes=payload.numel())
        msg = Message(header, [SegmentRecord(state.session_id, state.pos, 0, 0, 0)], payload=payload)
        reply, hop = self.relay(stage, msg)
        self._report([replace(hop, layers=f"{stage.layers} {kind} draft", tokens=reply.header.n_rows)])
        return reply

    @_locked
    def fork(self, state: RouteState, twin: RouteState) -> None:
        if state.dirty:
            twin.dirty = True
            return
        self._broadcast(Op.FORK, [self._record(state), self._record(twin)])

    @_locked
    def export(self, state: RouteState) -> dict:
        """Every remote layer's tensors of the state, as `host_parts` names them under `il/`."""
        self.sync(state)
        out: dict = {}
        for reply in self._broadcast(Op.EXPORT, [self._record(state)]):
            out.update(unpack_arrays(reply.payload))
        return out

    def _import(self, state: RouteState) -> None:
        """Send each worker its layers of a state written whole (from a payload)."""
        pending, state.pending = state.pending, {}
        state.reset_hash()
        n = len(state.tokens)
        record = SegmentRecord(state.session_id, 0, n, prefix_hash([]), state.token_hash())
        tokens = torch.tensor(state.tokens, dtype=torch.int64)
        for stage in list(self.stages):
            arrays = {
                f"{il}/{name}": a
                for il in range(stage.layers.first, stage.layers.last)
                for name, a in pending.get(il, {}).items()
            }
            payload = pack_arrays(arrays)
            header = Header(Op.IMPORT, next(self._requests), 1, n, payload.numel())
            self._call(stage, Message(header, [record], tokens, payload))
        state.dirty = False

    @staticmethod
    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
