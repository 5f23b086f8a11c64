"""`DistOptions`: what the `--dist-*` flags (and torchrun's or mlx.launch's environment) ask of this
process: its role in a layer pipeline, its layers, the coordinator's address and the transport.

It imports nothing heavy at module level, so the command line names the roles and transports
without loading torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dwarfstar.distributed.membership import LayerSlice
    from dwarfstar.model.file_v41 import ModelFile41
    from dwarfstar.model.loader import ModelFile

ROLES = ("coordinator", "worker")
DATA_BACKENDS = ("gloo", "nccl")  # torch.distributed process groups for the activations
RING = "mlx"  # the whole route on the mx.distributed ring (mlx.launch)
TRANSPORTS = (*DATA_BACKENDS, RING)
SECRET_ENV = "DWARFSTAR_DIST_SECRET"


@dataclass(frozen=True)
class DistOptions:
    role: str | None = None  # None: one process, no route
    layers: str | None = None
    addr: str | None = None
    bind: str | None = None
    stages: int = 2
    bits: int = 32
    prefill_chunk: int = 4096
    prefill_window: int = 1
    timeout_s: float = 600.0
    wait_s: float = 600.0
    secret: str = ""
    data_backend: str = "gloo"
    debug: bool = False
    mtp: bool = False  # the coordinator drafts with MTP: its last stage must hold the block

    @property
    def ring(self) -> bool:
        return self.data_backend == RING

    @classmethod
    def resolved(cls, **flags) -> DistOptions:
        """The flags, with torchrun's environment filling the role, address and stage count."""
        from dwarfstar.distributed.protocol import ACTIVATION_BITS, DistError

        opts = cls(**flags)
        if opts.data_backend not in TRANSPORTS:
            raise DistError(f"--dist-backend must be one of {', '.join(TRANSPORTS)}, got {opts.data_backend!r}")
        if opts.ring and opts.role is None and "MLX_RANK" in os.environ:
            opts = replace(opts, role="coordinator" if os.environ["MLX_RANK"] == "0" else "worker")
        if opts.role is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            role = "coordinator" if os.environ["RANK"] == "0" else "worker"
            opts = replace(opts, role=role, stages=int(os.environ["WORLD_SIZE"]))
            if opts.addr is None:
                port = int(os.environ.get("MASTER_PORT", "29500")) + 1
                opts = replace(opts, addr=f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}")
        opts = replace(opts, secret=opts.secret or os.environ.get(SECRET_ENV, ""))
        if opts.role is None:
            return opts
        if opts.role not in ROLES:
            raise DistError(f"--dist-role must be one of {', '.join(ROLES)}, got {opts.role!r}")
        if opts.addr is None and not opts.ring:
            raise DistError("a distributed role needs --dist-addr HOST:PORT (the coordinator's address)")
        if opts.bits not in ACTIVATION_BITS:
            raise DistError(f"--dist-activation-bits must be one of {', '.join(map(str, ACTIVATION_BITS))}")
        if opts.prefill_chunk < 1 or opts.prefill_window < 1:
            raise DistError("--dist-prefill-chunk and --dist-prefill-window must be positive")
        return opts

    def slice_for(self, model: ModelFile | ModelFile41, rank: int | None = None) -> LayerSlice:
        """--layers, else this rank's share of an even split by bytes (`rank`: the MLX ring's); a V4.1
        stage names its layers."""
        from dwarfstar.distributed.membership import LayerSlice, parse_layers, split_by_bytes
        from dwarfstar.distributed.protocol import DistError
        from dwarfstar.model.file_v41 import ModelFile41

        n = model.args.n_layers
        if isinstance(model, ModelFile41):
            return self.v41_slice(n)
        if self.layers is not None:
            return parse_layers(self.layers, n)
        if model.layers is not None:  # loaded for this role's slice (`stage_layers`)
            return LayerSlice(model.layers.start, model.layers.stop, n)
        plan = split_by_bytes(model, self.stages)
        if self.role == "coordinator":
            return plan[0]
        if rank is None:
            rank = int(os.environ.get("MLX_RANK" if self.ring else "RANK", "-1"))
        if not 0 < rank < len(plan):
            raise DistError("a worker started by hand needs --layers A:B (or A:output for the last one)")
        return plan[rank]

    def v41_slice(self, n_layers: int) -> LayerSlice:
        """A V4.1 stage's slice: its --layers, of `n_layers` (an even split would cut layers from their kv
        sources)."""
        from dwarfstar.distributed.membership import parse_layers
        from dwarfstar.distributed.protocol import DistError
        from dwarfstar.model.file_v41 import FAMILY41

        if self.layers is None:
            raise DistError(f"a stage of a {FAMILY41} route needs --layers A:B (or A:output for the last one)")
        return parse_layers(self.layers, n_layers)

    def stage_layers(self, path: str | os.PathLike) -> tuple[int, int] | None:
        """The layers this role loads (`EngineSpec.layers`): its slice (None: one process).

        The split by bytes reads only the file's tensor table; an MLX ring member's rank is MLX_RANK,
        which `mx.distributed.init` takes it from too. A V4.1 stage reads only the header of the file
        named (of a split set, its part: the other stages' parts need not be on this machine)."""
        from dwarfstar.model.file_v41 import config41
        from dwarfstar.model.loader import is_v41, open_model

        if self.role is None:
            return None
        if is_v41(Path(path)):
            layers = self.v41_slice(config41(path).n_layers)
            return layers.first, layers.last
        model = open_model(Path(path))
        try:
            layers = self.slice_for(model)
        finally:
            model.close()
        return layers.first, layers.last
