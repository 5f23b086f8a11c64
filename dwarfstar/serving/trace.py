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


def divergence(before: str, after: str, context: int = 120) -> dict[str, Any] | None:
    """Where `after` stops extending `before`: the first differing character and the text around it.

    None when `after` starts with all of `before` (a pure suffix was added, so a prefix cache hit is
    possible up to the end of `before`); a miss before that point is the client rewriting history.
    """
    if after.startswith(before):
        return None
    at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after)))
    start = max(0, at - context)
    return {
        "offset": at,
        "common": before[start:at],
        "before": before[at : at + context],
        "after": after[at : at + context],
    }
