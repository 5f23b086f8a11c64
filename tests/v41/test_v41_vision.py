"""Images with a DeepSeek V4.1 model (issues 33, 34): `--vision` loads V4.1 Flash's encoder beside it (its
image router biases are the language file's own), another family's or width's encoder is refused by name,
and through the server an image becomes a V4.1 block (START, rows of IMAGE then NEWLINE, END; causal),
which a later turn reuses from the KV."""

from __future__ import annotations

from dataclasses import replace

import httpx2 as httpx
import pytest
from live_server import start_server

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.synthetic import write_synthetic_vision
from dwarfstar.model.synthetic_v41 import V41_TINY
from dwarfstar.model.vision import V41, VISION_TINY
from dwarfstar.serving.config import ServerConfig
from tests.serving.test_vision_server import RED, blocks, body, session_tokens, usage

ENCODER = replace(VISION_TINY, family=V41, image_token_id=129264, out_dim=V41_TINY.dim)


@pytest.fixture(scope="module")
def v41_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41-vision") / "encoder.gguf"
    write_synthetic_vision(path, ENCODER, seed=1)
    return path


@pytest.fixture(scope="module")
def engine(v41_tiny_file, v41_encoder):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=4096, vision=v41_encoder))


def test_the_v41_encoder_loads_beside_a_v41_model(engine):
    assert engine.images is not None and engine.images.args.family == V41


def test_another_encoder_is_refused_by_name(v41_tiny_file, tiny_vision_file, tmp_path):
    with pytest.raises(DwarfStarError, match="Vision-Exp encoder; .* reads images through V4.1 Flash's encoder"):
        load_engine(EngineSpec(v41_tiny_file, "reference", vision=tiny_vision_file))
    wide = tmp_path / "wide.gguf"
    write_synthetic_vision(wide, replace(ENCODER, out_dim=2 * V41_TINY.dim), seed=1)
    with pytest.raises(DwarfStarError, match="rows 128 wide; .*hidden size is 64"):
        load_engine(EngineSpec(v41_tiny_file, "reference", vision=wide))


def test_an_image_through_the_server_is_a_v41_block_that_a_later_turn_reuses(engine):
    for server in start_server(engine, ServerConfig(ctx=4096, max_sessions=2, max_queue=8, prefill_chunk=256)):
        path, payload = body("chat", "What is this?", RED)
        payload["model"] = "deepseek-v4.1-flash"
        with httpx.Client(base_url=server.base_url, timeout=300) as client:
            first = client.post(path, json=payload)
            assert first.status_code == 200, first.text
            [tokens] = session_tokens(server)
            [(start, end)] = blocks(tokens, engine.tokenizer.vocab_size)
            placed = engine.images.args  # V4.1's layout: START, then rows of cols IMAGE + NEWLINE, then END
            assert (end - start - 2) % 2 == 0 and end - start <= placed.max_tokens
            again = client.post(path, json=payload)
        prompt, cached = usage("chat", again.json())
        assert again.status_code == 200 and cached >= end  # the block's KV is reused, not recomputed
