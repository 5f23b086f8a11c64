"""Who serves which layers: layer slices, the rendezvous store, registration and its checks.

The coordinator hosts a torch `TCPStore` on the socket it binds to `--dist-addr` (that address only,
never a wildcard). A worker waits until the store answers, takes a number with `add`, writes its
`Registration` as JSON and waits for the coordinator's verdict under `reply/N`; once accepted, both
join the 2-rank link `link/N` in the same store. With a shared secret the registration carries
HMAC-SHA256(secret, the coordinator's per-start nonce and N) instead of the secret itself.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import secrets
import socket
import time
from dataclasses import asdict, dataclass

from torch.distributed import TCPStore

from dwarfstar.distributed.protocol import PROTOCOL, DistError, RegistrationError
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.tensors_v41 import is_engram_table

OUTPUT = "output"
CONNECT_POLL_S = 0.2


@dataclass(frozen=True)
class LayerSlice:
    """Layers first..last-1 of a model of n_layers; the slice that ends the model holds the head."""

    first: int
    last: int
    n_layers: int

    @property
    def holds_head(self) -> bool:
        return self.last == self.n_layers

    def __str__(self) -> str:
        return f"{self.first}:{OUTPUT if self.holds_head else self.last}"


def parse_layers(text: str, n_layers: int) -> LayerSlice:
    """`A:B` (layers A..B-1) or `A:output` (A to the end, with the output head)."""
    first, sep, last = text.partition(":")
    try:
        a = int(first)
        b = n_layers if last == OUTPUT else int(last)
    except ValueError:
        raise DistError(f"--layers must be A:B or A:{OUTPUT} with integers, got {text!r}") from None
    if not sep or not 0 <= a < b <= n_layers:
        raise DistError(f"--layers {text!r} is not a non-empty range inside the model's 0:{n_layers} layers")
    return LayerSlice(a, b, n_layers)


def split_by_bytes(model: ModelFile, stages: int) -> list[LayerSlice]:
    """Contiguous slices with about equal tensor bytes each; the embedding counts with the first
    stage and the output head with the last, as they live there."""
    n = model.args.n_layers
    if not 1 <= stages <= n:
        raise DistError(f"cannot split {n} layers into {stages} stages")
    per_layer = [0] * n
    extra_first = extra_last = 0
    for name, info in model.gguf.tensors.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if il < n:
                per_layer[il] += info.nbytes
        elif name.startswith("token_embd"):
            extra_first += info.nbytes
        else:
            extra_last += info.nbytes
    total, done, cuts = sum(per_layer) + extra_first + extra_last, extra_first, []
    for il in range(n - 1):  # a cut after layer il
        done += per_layer[il]
        if len(cuts) == stages - 1:
            break
        share_reached = done >= total * (len(cuts) + 1) / stages
        if share_reached or n - il - 1 == stages - 1 - len(cuts):  # else a later stage would get no layer
            cuts.append(il + 1)
    bounds = [0, *cuts, n]
    return [LayerSlice(a, b, n) for a, b in zip(bounds, bounds[1:], strict=False)]


def model_identity(model: ModelFile | ModelFile41) -> tuple[str, str]:
    """(model id, quant): a digest of the config and the file's name metadata, and the types of the
    layer tensors mapped; a worker must match both to join a route. The types, not their counts: a
    stage of a split set maps only the parts holding its layers; and not a V4.1 Engram table's (I8 in
    every file), which only the parts holding an Engram layer have."""
    meta = model.gguf.metadata
    config = json.dumps([repr(model.args), meta.get("general.name", "")], sort_keys=True)
    tensors = model.gguf.tensors.items()
    types = {info.ggml_type.name for name, info in tensors if name.startswith("blk.") and not is_engram_table(name)}
    quant = ",".join(sorted(types))
    return hashlib.sha256(config.encode()).hexdigest()[:16], quant


@dataclass(frozen=True)
class Registration:
    model_id: str
    quant: str
    first: int
    last: int
    ctx: int
    host: str
    proof: str = ""
    mtp: bool = False  # it holds the head and a draft, and drafts (DRAFT)
    dspark: bool = False  # that draft is DSpark's (else the MTP block)
    protocol: int = PROTOCOL  # the worker's message set (a registration without one is version 1's)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Registration:
        try:
            return cls(**{"protocol": 1, **json.loads(raw)})
        except (ValueError, TypeError) as exc:
            raise RegistrationError(f"unreadable registration: {exc}") from None


def proof_for(secret: str, nonce: bytes, worker: int) -> str:
    return hmac.new(secret.encode(), nonce + str(worker).encode(), hashlib.sha256).hexdigest() if secret else ""


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not host or not 0 < number < 65536:
        raise DistError(f"--dist-addr must be HOST:PORT, got {text!r}")
    return host.strip("[]"), number


def local_host_toward(host: str) -> str:
    """This machine's address on the interface that reaches `host` (no packet is sent): what a
    worker's gloo pair binds when no --dist-bind is given, so it listens on that one address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError as exc:
            raise DistError(f"no route to the coordinator at {host}: {exc}") from None


class Rendezvous:
    """The coordinator's side: the store on the given address, and the registrations arriving in it."""

    def __init__(self, host: str, port: int, secret: str, timeout_s: float) -> None:
        self.host, self.port, self.secret = host, port, secret
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(64)
        except OSError as exc:
            listener.close()
            raise DistError(f"cannot listen on {host}:{port}: {exc}") from None
        self.store = TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            timeout=dt.timedelta(seconds=timeout_s),
        )
        listener.detach()  # the store owns the listening socket now, and closes it
        self.nonce = secrets.token_bytes(16)
        self.store.set("nonce", self.nonce)
        self.seen = 0

    def arrivals(self) -> list[tuple[int, Registration | RegistrationError]]:
        """Registrations written since the last call, by worker number (an unreadable one as its error)."""
        count = self.store.add("workers", 0)
        out: list[tuple[int, Registration | RegistrationError]] = []
        for worker in range(self.seen + 1, count + 1):
            try:
                self.store.wait([f"register/{worker}"], dt.timedelta(seconds=10))
                reg: Registration | RegistrationError = Registration.from_json(self.store.get(f"register/{worker}"))
            except RegistrationError as exc:
                reg = exc
            except RuntimeError:
                reg = RegistrationError(f"worker {worker} took a number but never registered")
            out.append((worker, reg))
        self.seen = count
        return out

    def check_secret(self, worker: int, reg: Registration) -> None:
        if not hmac.compare_digest(reg.proof, proof_for(self.secret, self.nonce, worker)):
            raise RegistrationError(f"worker {worker} at {reg.host} did not present the route's shared secret")

    def answer(self, worker: int, refusal: str | None) -> None:
        self.store.set(f"reply/{worker}", "ok" if refusal is None else f"refused: {refusal}")


def connect_store(host: str, port: int, wait_s: float) -> TCPStore:
    """A client of the coordinator's store, waiting up to wait_s for it to listen (either side may start first)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass
            return TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=max(1.0, wait_s)))
        except (OSError, RuntimeError):
            if time.monotonic() > deadline:
                raise DistError(f"no coordinator answered at {host}:{port} within {wait_s:.0f} s") from None
            time.sleep(CONNECT_POLL_S)


def register(store: TCPStore, reg: Registration, secret: str, wait_s: float) -> int:
    """Register with the coordinator; its worker number once accepted, else its reason as an error."""
    worker = store.add("workers", 1)
    nonce = store.get("nonce")
    signed = Registration(**{**asdict(reg), "proof": proof_for(secret, nonce, worker)})
    store.set(f"register/{worker}", signed.to_json())
    try:
        store.wait([f"reply/{worker}"], dt.timedelta(seconds=wait_s))
    except RuntimeError:
        raise DistError(f"the coordinator did not answer registration {worker} within {wait_s:.0f} s") from None
    verdict = store.get(f"reply/{worker}").decode()
    if verdict != "ok":
        raise RegistrationError(f"the coordinator {verdict}")
    return worker
