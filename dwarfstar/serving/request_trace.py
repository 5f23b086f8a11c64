"""`--trace FILE`: one JSON line per finished request, to see what the model was asked and said.

Each record holds the client's request, the rendered prompt, where its KV came from and how many
tokens were reused and prefilled, the generated text, the sampled DSML block and the tool-call ids
(replayed ones included), so an exact-replay or cache question can be answered from the file alone.

A cache miss is explained in the record: `divergence` shows where the prompt's bytes stop
extending the closest of the last few traced conversations (prompt plus generated text, what a live
session holds), with the text on both sides, so a client rewriting an early block is visible.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import orjson

RECENT_CONVERSATIONS = 8  # about the live sessions a server keeps


class Trace:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")
        self._lock = threading.Lock()
        self._recent: deque[str] = deque(maxlen=RECENT_CONVERSATIONS)

    def _explain_miss(self, record: dict[str, Any]) -> dict[str, Any] | None:
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            return None
        where = None
        if self._recent and record.get("cached_tokens", 0) < record.get("prompt_tokens", 0):
            # the most recent of equally close ones: the conversation as it last stood
            closest = max(reversed(self._recent), key=lambda text: len(os.path.commonprefix([text, prompt])))
            where = divergence(closest, prompt)
        self._recent.append(prompt + str(record.get("generated") or ""))
        return where

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            where = self._explain_miss(record)
        if where is not None:
            record = {**record, "divergence": where}
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
