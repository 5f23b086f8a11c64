"""A member of the MLX ring test route: `MLX_RANK=r MLX_HOSTFILE=f python ring_member.py MODEL OUT.npz [MTP]`.

Rank 0 is the coordinator: it writes its single-process and route logits of the same prompt, and
the greedy continuations of both, to OUT.npz, then shuts the worker down. With an MTP file (the
bundled model's block), the last stage drafts with it, and the coordinator writes the greedy
speculative continuations and their figures, one process's and the route's, instead of the logits.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from dwarfstar.distributed.backend import RouteBackend
from dwarfstar.engine.launch import DistOptions, run_worker, start_coordinator
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import load_speculation
from dwarfstar.speculative.mtp_options import MTPOptions

CTX = 128
# BOS and "Quel ramo del lago di Como, che vol": from a prompt of the book, the bundled model's greedy
# text is prose its MTP block drafts (from arbitrary ids it loops over word pieces no draft guesses)
PROMPT = [0, 4100, 317, 14982, 81, 1543, 116338, 1298, 42029, 14, 1639, 2538]
GREEDY = SamplingParams(temperature=0.0)


def greedy(backend, n: int) -> np.ndarray:
    session = Session(backend, ctx=CTX)
    session.prefill(PROMPT)
    return np.array(list(session.generate(n, GREEDY)))


def plain(backend) -> dict[str, np.ndarray]:
    logits = backend.forward(PROMPT, backend.new_state(), all_logits=True).cpu().numpy()
    return {"logits": logits, "greedy": greedy(backend, 8)}


def speculative(engine, speculation: MTPOptions) -> dict[str, np.ndarray]:
    spec = load_speculation(speculation, engine.backend, engine.model).start(Session(engine.backend, ctx=CTX))
    spec.prefill(PROMPT)
    tokens = list(spec.generate(24, GREEDY))
    stats = spec.stats
    return {"greedy": np.array(tokens), "figures": np.array([stats.steps, stats.rollbacks, *stats.accepted])}


def main() -> None:
    model, out = sys.argv[1:3]
    # without QAT rounding one process's greedy speculation is exact (tests/speculative)
    qat = len(sys.argv) < 4
    speculation = None if qat else MTPOptions(Path(sys.argv[3]), 2)
    opts = DistOptions.resolved(data_backend="mlx", layers="0:3" if os.environ["MLX_RANK"] == "0" else "3:output")
    if opts.role == "worker":  # its slice only; the coordinator loads every layer, to compare with one process
        run_worker(
            load_engine(EngineSpec(model, "mlx", qat=qat, ctx=CTX, dist=opts)),
            opts,
            CTX,
            speculation,
        )
        return
    engine = load_engine(EngineSpec(model, "mlx", qat=qat, ctx=CTX))
    local = engine.backend
    opts = replace(opts, mtp=speculation is not None)
    route = start_coordinator(engine, opts, CTX)
    figures = {}
    for name, backend in (("local", local), ("route", RouteBackend(route))):
        engine.backend = backend
        found = plain(backend) if speculation is None else speculative(engine, speculation)
        figures.update({f"{name}_{key}": value for key, value in found.items()})
    if speculation is not None:
        figures["plain_greedy"] = greedy(local, 24)
    route.close()
    np.savez(out, **figures)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown (seconds on loaded cores): the figures are written
