"""A worker process for the distributed tests: `python stage_worker.py MODEL LAYERS HOST:PORT THREADS [KEY=VALUE...]`.

Options: `die=ROWS`: the process exits abruptly when a FORWARD of that many rows arrives, before it
replies (a worker that dies in the middle of a request, at a point the test chooses); `mtp=FILE`:
the last stage loads that MTP block and drafts; `dspark=FILE`: that DSpark drafter; `qat=0`: no QAT
rounding (as the coordinator's engine).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from dwarfstar.distributed.protocol import Op
from dwarfstar.distributed.stage import StageWorker
from dwarfstar.engine.launch import DistOptions, run_worker
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.speculative.mtp_options import DSparkOptions, MTPOptions

CTX = 256


def main() -> None:
    model, layers, addr, threads, *rest = sys.argv[1:]
    options = dict(arg.split("=", 1) for arg in rest)
    torch.set_num_threads(int(threads))
    if "die" in options:
        die_at = int(options["die"])
        handle = StageWorker.handle

        def dying(self, msg):
            if msg.header.op == Op.FORWARD and msg.header.n_rows == die_at:
                os._exit(17)
            return handle(self, msg)

        StageWorker.handle = dying
    speculation = MTPOptions(Path(options["mtp"]), 2) if "mtp" in options else None
    if "dspark" in options:
        speculation = DSparkOptions(Path(options["dspark"]))
    opts = DistOptions.resolved(role="worker", layers=layers, addr=addr, wait_s=300, timeout_s=60)
    qat = options.get("qat", "1") != "0"
    engine = load_engine(EngineSpec(model, "reference", ctx=CTX, qat=qat, dist=opts))  # its slice only
    run_worker(engine, opts, CTX, speculation)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown (seconds on loaded cores): nothing is left to flush
