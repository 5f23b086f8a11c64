"""Prefix reuse through an image across a conversation's turns, as `serve --vision` gives it.

A three-turn chat whose first message carries a screenshot, sent by a stateless client (the whole
conversation every turn) to a server on the tiny synthetic model with the `vision-tiny` encoder
(reference backend), three times: without the disk KV cache, with it, and with it after a restart of
the server (a new service over the same cache directory; the same process, so the encoder's own
cache is warm). Prints per turn the prompt tokens, the cached and prefilled ones and the wall time,
and the server's image counters.

    python tools/image_turns.py [--size 640x480]
"""

from __future__ import annotations

import argparse
import base64
import io
import re
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from starlette.testclient import TestClient

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.synthetic import TINY, VISION_PRESETS, write_synthetic_model, write_synthetic_vision
from dwarfstar.model.vision import VISION_TINY
from dwarfstar.serving.app import create_app
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.service import Service

TURNS = ("What is in this screenshot?", "Which colour dominates?", "Thanks.")


def screenshot(width: int, height: int) -> str:
    pixels = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def conversation(client: TestClient, image: str, label: str) -> None:
    history: list[dict] = []
    for n, text in enumerate(TURNS):
        content = [{"type": "text", "text": text}]
        if n == 0:
            content.append({"type": "image_url", "image_url": {"url": image}})
        history.append({"role": "user", "content": content})
        body = {"model": "deepseek-v4-flash", "messages": history, "max_tokens": 8, "temperature": 0}
        began = time.perf_counter()
        reply = client.post("/v1/chat/completions", json=body)
        seconds = time.perf_counter() - began
        if reply.status_code != 200:
            raise SystemExit(f"{label} turn {n + 1}: HTTP {reply.status_code}: {reply.text}")
        usage = reply.json()["usage"]
        details = usage["prompt_tokens_details"]
        print(
            f"{label} turn {n + 1}: prompt {usage['prompt_tokens']}, cached {details['cached_tokens']}, "
            f"prefilled {details['cache_write_tokens']}, {seconds:.2f} s"
        )
        history.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"] or "."})
    counters = client.get("/metrics").text
    images = metric(counters, "dwarfstar_images_total")
    encoded = metric(counters, "dwarfstar_images_encoded_total")
    print(f"{label}: images {images:g}, encoded {encoded:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="640x480", help="the screenshot's WIDTHxHEIGHT")
    width, height = (int(v) for v in parser.parse_args().size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_synthetic_model(root / "tiny.gguf", TINY, seed=0)
        write_synthetic_vision(root / "encoder.gguf", VISION_TINY, seed=1, router=VISION_PRESETS["vision-tiny"][1])
        engine = load_engine(EngineSpec(root / "tiny.gguf", "reference", ctx=4096, vision=root / "encoder.gguf"))
        image = screenshot(width, height)
        runs = [("memory", None), ("disk", root / "kv"), ("disk, restarted", root / "kv")]
        for label, disk in runs:
            config = ServerConfig(ctx=4096, max_sessions=2, prefill_chunk=256, kv_disk_dir=disk, kv_cache_min_tokens=16)
            with TestClient(create_app(Service(engine, config))) as client:
                conversation(client, image, label)


if __name__ == "__main__":
    main()
