"""`--trace FILE`: one JSON line per finished request, to see what the model was asked and said.

Each record holds the client's request, the rendered prompt, where its KV came from and how many
tokens were reused and prefilled, the generated text, the sampled DSML block and the tool-call ids
(replayed ones included), so an exact-replay or cache question can be answered from the file alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import orjson


class Trace:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = orjson.dumps({"time": round(time.time(), 3), **record}, default=str) + b"\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
