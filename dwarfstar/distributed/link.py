"""One coordinator-worker link: two ranks, a gloo side group for headers and a data group for activations.

The data group is the side group itself on CPUs (gloo); on GPUs it is NCCL (RCCL on ROCm, which
torch names nccl too), so activations move device to device while the small headers, token ids and
logits stay on gloo. Every wait has a deadline: a peer that is gone or silent past it breaks the link
(gloo closes a pair on a timeout), which the caller sees as `LinkBrokenError`, never a hang.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from dwarfstar.distributed.dist_options import DATA_BACKENDS
from dwarfstar.distributed.protocol import (
    FLAG_LOGITS,
    HEADER,
    SEGMENT_FIELDS,
    DistError,
    Header,
    Op,
    SegmentRecord,
    Status,
    pack_segments,
    unpack_segments,
)

SIDE_TAG, DATA_TAG = 0, 1


class LinkBrokenError(DistError):
    """The peer disconnected, crashed or missed its deadline; the link is unusable from now on."""


@dataclass
class Message:
    header: Header
    segments: list[SegmentRecord] = field(default_factory=list)
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    payload: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))

    @property
    def payload_on_data(self) -> bool:
        """Activations travel on the data group; logits, layer tensors and text on the side group."""
        h = self.header
        return h.op == Op.FORWARD and h.status == Status.OK and not h.flags & FLAG_LOGITS


class Link:
    def __init__(
        self,
        store: Store,
        prefix: str,
        rank: int,
        host: str,
        timeout_s: float,
        data_backend: str = "gloo",
        device: torch.device | str = "cpu",
    ) -> None:
        """Join the link named `prefix` in `store` as rank 0 (coordinator) or 1 (worker); blocks until
        the peer joins or `timeout_s` passes. `host` is the only address this side's gloo pair binds."""
        if data_backend not in DATA_BACKENDS:
            raise DistError(f"unknown --dist-backend {data_backend!r}; choose one of {', '.join(DATA_BACKENDS)}")
        self.rank, self.peer, self.device = rank, 1 - rank, torch.device(device)
        self.timeout = dt.timedelta(seconds=timeout_s)
        opts = ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        try:
            self.side = ProcessGroupGloo(PrefixStore(f"{prefix}/side", store), rank, 2, opts)
            self.data = self.side
            if data_backend == "nccl":
                from torch.distributed import ProcessGroupNCCL

                self.data = ProcessGroupNCCL(PrefixStore(f"{prefix}/data", store), rank, 2)
        except (RuntimeError, ImportError) as exc:
            raise LinkBrokenError(f"could not open the {data_backend} link {prefix}: {exc}") from None
        self.bytes_sent = self.bytes_received = 0
        self.last_send_done = 0.0  # when the last send completed, for the per-hop telemetry

    def send(self, msg: Message, deadline_s: float | None = None) -> None:
        h = msg.header
        parts = [(self.side, SIDE_TAG, h.pack())]
        if h.n_segments:
            parts.append((self.side, SIDE_TAG, pack_segments(msg.segments)))
        if h.n_rows:
            parts.append((self.side, SIDE_TAG, msg.tokens.to(torch.int64).contiguous()))
        if h.payload_bytes:
            group = self.data if msg.payload_on_data else self.side
            payload = msg.payload.to(self.device) if group is not self.side else msg.payload.cpu()
            parts.append((group, DATA_TAG if group is not self.side else SIDE_TAG, payload.contiguous()))
        works = [(group.send([t], self.peer, tag), t) for group, tag, t in parts]
        for work, t in works:
            self._wait(work, deadline_s)
            self.bytes_sent += t.numel() * t.element_size()
        self.last_send_done = time.perf_counter()

    def recv(self, deadline_s: float | None = None) -> Message:
        """The next message; `deadline_s` None waits as long as the link's timeout (a worker's idle wait)."""
        raw = self._recv(self.side, SIDE_TAG, torch.empty(HEADER.size, dtype=torch.uint8), deadline_s)
        header = Header.unpack(raw)
        msg = Message(header)
        if header.n_segments:
            table = torch.empty(header.n_segments, SEGMENT_FIELDS, dtype=torch.int64)
            msg.segments = unpack_segments(self._recv(self.side, SIDE_TAG, table, deadline_s), header.n_rows)
        if header.n_rows:
            msg.tokens = self._recv(self.side, SIDE_TAG, torch.empty(header.n_rows, dtype=torch.int64), deadline_s)
        if header.payload_bytes:
            on_data = msg.payload_on_data and self.data is not self.side
            buf = torch.empty(header.payload_bytes, dtype=torch.uint8, device=self.device if on_data else "cpu")
            msg.payload = self._recv(
                self.data if on_data else self.side, DATA_TAG if on_data else SIDE_TAG, buf, deadline_s
            )
        return msg

    def request(self, msg: Message, deadline_s: float) -> Message:
        self.send(msg, deadline_s)
        return self.recv(deadline_s)

    def _recv(self, group, tag: int, buf: torch.Tensor, deadline_s: float | None) -> torch.Tensor:
        self._wait(group.recv([buf], self.peer, tag), deadline_s)
        self.bytes_received += buf.numel() * buf.element_size()
        return buf

    def _wait(self, work, deadline_s: float | None) -> None:
        try:
            if deadline_s is None:
                work.wait()
            else:
                work.wait(dt.timedelta(seconds=deadline_s))
        except RuntimeError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LinkBrokenError(f"link to rank {self.peer} broken: {first_line}") from None
