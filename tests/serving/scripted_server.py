"""`dwarfstar serve` with the test suite's scripted backend, for driving real clients through tool calls.

    python -m tests.serving.scripted_server --port 18700 --scripts scripts.json --trace trace.jsonl

The model is the tiny random one the server tests use, wrapped in conftest's `ScriptedBackend`: a
prompt whose last user turn holds `[[script:NAME]]` gets the text `scripts.json` gives for NAME
(DSML tool calls included), sampled token by token; any other prompt gets random tokens. A tool
result that contains a marker (a file the scripted call reads, say) scripts the answer after it.
With `--vision` the server reads images through the random `vision-tiny` encoder, so a client's
image reaches the model as an image block (the trace's `image_blocks`).
This is a test entry point, not part of the `dwarfstar` command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import uvicorn

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.synthetic import TINY, VISION_PRESETS, write_synthetic_model, write_synthetic_vision
from dwarfstar.model.vision import VISION_TINY
from dwarfstar.serving.app import create_app
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.service import Service

# conftest and the live server it imports (tests/) are imported the way pytest imports them
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
from conftest import ScriptedBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--scripts", type=Path, required=True, help="JSON object: script name -> model text")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--ctx", type=int, default=TINY.max_seq_len)
    parser.add_argument("--vision", action="store_true", help="read images (the random vision-tiny encoder)")
    args = parser.parse_args()
    scripts = json.loads(args.scripts.read_text())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tiny.gguf"
        write_synthetic_model(path, TINY, seed=0)
        vision = Path(folder) / "vision-tiny.gguf" if args.vision else None
        if vision is not None:
            write_synthetic_vision(vision, VISION_TINY, seed=1, router=VISION_PRESETS["vision-tiny"][1])
        engine = load_engine(EngineSpec(path, "reference", ctx=args.ctx, vision=vision))
        engine.backend = ScriptedBackend(engine.backend, engine.tokenizer, scripts)
        # every model name is accepted: clients ask for their own background models too
        config = ServerConfig(ctx=args.ctx, trace=args.trace, model_aliases=("*",), max_sessions=4)
        uvicorn.run(create_app(Service(engine, config)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
