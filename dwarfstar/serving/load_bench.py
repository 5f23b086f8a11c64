"""`dwarfstar bench serve`: `dwarfstar serve` started on loopback, N concurrent streaming clients,
then N more requests one after another, for each N.

Reported per N: time to first token (mean and worst), aggregate decode rate (all generated tokens
over the time from the first client's first token to the last client's last token), the same rate
with the requests serialised, and their ratio: what batching the decode steps buys (medians over
`repeats` rounds, each a batched run then its serialised twin). Every request
has its own prompt, so neither run gets a prefix-cache hit the other did not. Clients speak plain
HTTP/SSE from the standard library, so the bench needs no SDK; the server runs in its own process,
so the clients do not compete with it for the interpreter lock.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.errors import DwarfStarError
from dwarfstar.serving.config import API_KEY_ENV


@dataclass
class Timing:
    start: float
    first_token: float
    end: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_one(port: int, prompt: str, tokens: int) -> Timing:
    body = {
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "thinking": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:  # a request the server refuses (its output over --ctx, say) is no timing
        raise DwarfStarError(f"the server answered {response.status}: {response.read().decode(errors='replace')}")
    first = None
    count = 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            count = chunk["usage"]["completion_tokens"]
        elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return Timing(start, first or end, end, count)


def _decode_rate(timings: list[Timing]) -> float:
    span = max(t.end for t in timings) - min(t.first_token for t in timings)
    return sum(t.tokens for t in timings) / max(span, 1e-9)


def _wait_until_up(port: int, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DwarfStarError(f"the server exited with status {process.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise DwarfStarError("the server did not come up")


def run_bench(
    model: Path,
    *,
    backend: str,
    clients: list[int],
    tokens: int,
    ctx: int,
    repeats: int = 1,
    server_args: Sequence[str] = (),
) -> Iterator[str]:
    """`repeats`: rounds of (batched, serialised) per client count, reported as medians, so that a
    load spike on a shared machine in one round does not decide the ratio; `server_args`: more
    `dwarfstar serve` flags (a steering direction)."""
    port = _free_port()
    command = [sys.executable, "-m", "dwarfstar", "serve", "-m", str(model), "--backend", backend, *server_args]
    command += ["--port", str(port), "--ctx", str(ctx), "--nothink"]
    command += ["--max-sessions", str(max(clients)), "--max-queue", str(max(clients))]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # its clients send no key
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _wait_until_up(port, process)
        stream_one(port, "Warm up.", 4)
        rounds = f", median of {repeats} rounds" if repeats > 1 else ""
        yield f"model {model.name} ({backend} backend), {tokens} tokens per request, greedy, no thinking{rounds}"
        yield "clients  ttft_mean_ms  ttft_max_ms  batched_tok_s  serial_tok_s  speedup"
        for n in clients:
            ttfts, batched, serial = [], [], []
            for r in range(repeats):
                prompts = [f"Request {i} of {n}, round {r}: write about anything." for i in range(n)]
                with ThreadPoolExecutor(n) as pool:
                    together = list(pool.map(lambda p: stream_one(port, p, tokens), prompts))
                alone = [stream_one(port, "Again. " + p, tokens) for p in prompts]
                ttfts += [t.ttft * 1000 for t in together]
                batched.append(_decode_rate(together))
                serial.append(sum(t.tokens for t in alone) / sum(t.end - t.first_token for t in alone))
            speedup = statistics.median(b / s for b, s in zip(batched, serial, strict=True))
            yield (
                f"{n:7d}  {statistics.mean(ttfts):12.1f}  {max(ttfts):11.1f}  {statistics.median(batched):13.1f}  "
                f"{statistics.median(serial):12.1f}  {speedup:6.2f}x"
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
