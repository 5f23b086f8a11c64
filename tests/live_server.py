"""A live `dwarfstar serve` application on a loopback uvicorn, for tests that drive it with real
clients (the official SDKs, raw HTTP)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from dwarfstar.engine.load import Engine
from dwarfstar.serving.app import KEEP_ALIVE_SECONDS, create_app
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.service import Service


@dataclass
class LiveServer:
    base_url: str
    service: Service
    trace: Path | None

    def metric(self, name: str, **labels: str) -> float:
        return self.service.metrics.value(name, **labels)

    def trace_records(self) -> list[dict]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()]


# Ports below Linux's ephemeral range (32768-60999): an outgoing connection takes its local port
# from that range, so it cannot take one of these between the test's choice and the listener's bind
# (which may come minutes later for a distributed cluster). Each xdist worker draws from its own block.
PORT_BLOCK = 2000
FIRST_PORT = 20000
_given: set[int] = set()


def free_port() -> int:
    """A loopback port free now, never given before in this process, from this xdist worker's block."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = FIRST_PORT + (worker % 6) * PORT_BLOCK
    for port in range(first, first + PORT_BLOCK):
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {first}-{first + PORT_BLOCK - 1}")


def start_server(engine: Engine, config: ServerConfig) -> Iterator[LiveServer]:
    service = Service(engine, config)
    port = free_port()
    listening = uvicorn.Config(
        create_app(service), host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_SECONDS
    )
    server = uvicorn.Server(listening)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", service, config.trace)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
