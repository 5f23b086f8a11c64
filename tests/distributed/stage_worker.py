"""A worker process for the distributed tests: `python stage_worker.py MODEL LAYERS HOST:PORT THREADS [DIE_AT_ROWS]`.

With DIE_AT_ROWS the process exits abruptly when a FORWARD of that many rows arrives, before it
replies: a worker that dies in the middle of a request, at a point the test chooses.
"""

from __future__ import annotations

import os
import sys

import torch

from dwarfstar.distributed.launch import DistOptions, run_worker
from dwarfstar.distributed.protocol import Op
from dwarfstar.distributed.stage import StageWorker
from dwarfstar.engine import load_engine

CTX = 256


def main() -> None:
    model, layers, addr, threads = sys.argv[1:5]
    torch.set_num_threads(int(threads))
    if len(sys.argv) > 5:
        die_at = int(sys.argv[5])
        handle = StageWorker.handle

        def dying(self, msg):
            if msg.header.op == Op.FORWARD and msg.header.n_rows == die_at:
                os._exit(17)
            return handle(self, msg)

        StageWorker.handle = dying
    opts = DistOptions.resolved(role="worker", layers=layers, addr=addr, wait_s=300, timeout_s=60)
    engine = load_engine(model, "reference", ctx=CTX, layers=opts.stage_layers(model))  # its slice only
    run_worker(engine, opts, CTX)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown (seconds on loaded cores): nothing is left to flush
