"""A member of the MLX ring test route: `MLX_RANK=r MLX_HOSTFILE=f python ring_member.py MODEL OUT.npz`.

Rank 0 is the coordinator: it writes its single-process and route logits of the same prompt, and
the greedy continuations of both, to OUT.npz, then shuts the worker down.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from dwarfstar.distributed.backend import RouteBackend
from dwarfstar.distributed.launch import DistOptions, run_worker, start_coordinator
from dwarfstar.engine import load_engine
from dwarfstar.session.sampling import SamplingParams
from dwarfstar.session.session import Session

CTX = 128
PROMPT = [0, 17, 42, 7, 99, 1000, 5, 31, 64, 2, 11, 128]


def main() -> None:
    model, out = sys.argv[1:3]
    opts = DistOptions.resolved(data_backend="mlx", layers="0:3" if os.environ["MLX_RANK"] == "0" else "3:output")
    if opts.role == "worker":  # its slice only; the coordinator loads every layer, to compare with one process
        run_worker(load_engine(model, "mlx", ctx=CTX, layers=opts.stage_layers(model)), opts, CTX)
        return
    engine = load_engine(model, "mlx", ctx=CTX)
    local = engine.backend
    route = start_coordinator(engine, opts, CTX)
    routed = RouteBackend(route)
    figures = {}
    for name, backend in (("local", local), ("route", routed)):
        figures[f"{name}_logits"] = backend.forward(PROMPT, backend.new_state(), all_logits=True).cpu().numpy()
        session = Session(backend, ctx=CTX)
        session.prefill(PROMPT)
        figures[f"{name}_greedy"] = np.array(list(session.generate(8, SamplingParams(temperature=0.0))))
    route.close()
    np.savez(out, **figures)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown (seconds on loaded cores): the figures are written
