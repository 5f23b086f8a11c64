"""The route over `mx.distributed` for Apple machines: the ring backend (TCP), as `mlx.launch` starts it.

`mlx.launch` (or MLX_RANK and MLX_HOSTFILE by hand) fixes the members at the start: rank 0 is the
coordinator, each other rank registers over its link with the same `Registration` and checks as a
torch worker, and the route is whole once all have. The ring backend sends only between neighbours
in the ring, so the coordinator's star reaches ranks 1 and size-1: at most 3 stages. It has no
deadlines either, so a ring route waits for a silent peer instead of dropping it, and a member that
leaves cannot rejoin (start the ring again); on TCP a peer that dies closes its socket, which fails.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dwarfstar.distributed.link import Message
from dwarfstar.distributed.membership import Registration, proof_for
from dwarfstar.distributed.protocol import (
    HEADER,
    SEGMENT_FIELDS,
    DistError,
    Header,
    Op,
    RegistrationError,
    Status,
    as_bytes,
    pack_segments,
    unpack_segments,
)

MAX_RING_STAGES = 3
RING_NONCE = b"mlx-ring"  # the ring's members are fixed at launch, so the proof needs no fresh nonce


class MLXRingLink:
    """`Link`'s interface over one pair of ranks of an MLX group (deadlines are not supported)."""

    def __init__(self, group, peer: int) -> None:
        import mlx.core as mx

        self.mx, self.group, self.peer = mx, group, peer
        self.bytes_sent = self.bytes_received = 0
        self.last_send_done = 0.0

    def _send(self, t: torch.Tensor) -> None:
        arr = self.mx.array(t.cpu().numpy())
        try:
            self.mx.eval(self.mx.distributed.send(arr, self.peer, group=self.group))
        except RuntimeError as exc:
            raise DistError(f"MLX ring send to rank {self.peer} failed: {exc}") from None
        self.bytes_sent += t.numel() * t.element_size()

    def _recv(self, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        template = self.mx.zeros(shape, dtype=self.mx.uint8 if dtype == np.uint8 else self.mx.int64)
        try:
            arr = self.mx.distributed.recv_like(template, self.peer, group=self.group)
            self.mx.eval(arr)
        except RuntimeError as exc:
            raise DistError(f"MLX ring receive from rank {self.peer} failed: {exc}") from None
        out = torch.from_numpy(np.array(arr, dtype=dtype))
        self.bytes_received += out.numel() * out.element_size()
        return out

    def send(self, msg: Message, deadline_s: float | None = None) -> None:
        h = msg.header
        self._send(h.pack())
        if h.n_segments:
            self._send(pack_segments(msg.segments))
        if h.n_rows:
            self._send(msg.tokens.to(torch.int64))
        if h.payload_bytes:
            self._send(msg.payload)
        self.last_send_done = time.perf_counter()

    def recv(self, deadline_s: float | None = None) -> Message:
        header = Header.unpack(self._recv((HEADER.size,), np.uint8))
        msg = Message(header)
        if header.n_segments:
            msg.segments = unpack_segments(self._recv((header.n_segments, SEGMENT_FIELDS), np.int64), header.n_rows)
        if header.n_rows:
            msg.tokens = self._recv((header.n_rows,), np.int64)
        if header.payload_bytes:
            msg.payload = self._recv((header.payload_bytes,), np.uint8)
        return msg

    def request(self, msg: Message, deadline_s: float) -> Message:
        self.send(msg)
        return self.recv()


def ring_group():
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True, backend="ring")
    except RuntimeError as exc:
        raise DistError(
            f"cannot join the MLX ring (start it with mlx.launch, or MLX_RANK and MLX_HOSTFILE): {exc}"
        ) from None
    if group.size() > MAX_RING_STAGES:
        raise DistError(f"the MLX ring sends only to neighbours: a route on it has at most {MAX_RING_STAGES} stages")
    return group


def register_over_ring(link: MLXRingLink, reg: Registration, secret: str, rank: int) -> None:
    """A ring member's registration: its answer is OK or the coordinator's reason as an error."""
    signed = Registration(**{**reg.__dict__, "proof": proof_for(secret, RING_NONCE, rank)})
    body = as_bytes(signed.to_json())
    reply = link.request(Message(Header(Op.REGISTER, payload_bytes=body.numel()), payload=body), 0)
    if reply.header.status != Status.OK:
        raise RegistrationError(f"the coordinator refused: {bytes(reply.payload.numpy()).decode()}")


def admit_ring(route, group, secret: str) -> None:
    """The coordinator takes every other rank's registration; a refused one ends the start."""
    for rank in range(1, group.size()):
        link = MLXRingLink(group, rank)
        msg = link.recv()
        try:
            if msg.header.op != Op.REGISTER:
                raise RegistrationError(f"rank {rank} sent {msg.header.op.name} before registering")
            reg = Registration.from_json(bytes(msg.payload.numpy()))
            if reg.proof != proof_for(secret, RING_NONCE, rank):
                raise RegistrationError(f"rank {rank} did not present the route's shared secret")

            def accept(link=link, msg=msg) -> MLXRingLink:
                link.send(Message(Header(Op.REGISTER, msg.header.request)))
                return link

            route.admit(rank, reg, accept)
        except RegistrationError as exc:
            reason = as_bytes(str(exc).encode())
            link.send(Message(Header(Op.REGISTER, status=Status.ERROR, payload_bytes=reason.numel()), payload=reason))
            raise
