"""Which `model` names this server answers to, and the model objects `/v1/models` lists.

The loaded file is V4 Flash or PRO, or V4.1 Flash, which `/v1/models` and `/health` name by its own id
(`deepseek-v4.1-flash` for V4.1). Every DeepSeek id (and the `deepseek-chat`/`deepseek-reasoner`
thinking aliases) names it, since clients are configured with one name and the server has one model.
Any other name is a 404 unless `--model-alias` patterns admit it (e.g. `claude-*` for Claude Code's
background model).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import FAMILY41
from dwarfstar.serving.errors import ApiError

FLASH_ID = "deepseek-v4-flash"
PRO_ID = "deepseek-v4-pro"
V41_FLASH_ID = "deepseek-v4.1-flash"
ALIASES = (FLASH_ID, PRO_ID, V41_FLASH_ID, "deepseek-chat", "deepseek-reasoner")
CREATED = 1767225600  # ds4's fixed creation time (2026-01-01)
SUPPORTED_PARAMETERS = [
    "tools",
    "tool_choice",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stream",
    "reasoning_effort",
]


class ModelCatalog:
    def __init__(self, args: ModelArgs | ModelArgs41, ctx: int, aliases: tuple[str, ...] = ()) -> None:
        if isinstance(args, ModelArgs41):
            self.id, self.display_name = V41_FLASH_ID, FAMILY41
        elif args.n_layers == ModelArgs.pro().n_layers:
            self.id, self.display_name = PRO_ID, "DeepSeek V4 PRO"
        else:
            self.id, self.display_name = FLASH_ID, "DeepSeek V4 Flash"
        self.ctx = ctx
        self.patterns = aliases

    def knows(self, name: str) -> bool:
        return name in ALIASES or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)

    def resolve(self, name: str | None) -> str:
        """The name to echo back; 404 for a model this server does not serve."""
        if name is None:
            return self.id
        if not self.knows(name):
            raise ApiError(
                404, f"model {name!r} not found; this server serves {self.id}", param="model", code="model_not_found"
            )
        return name

    def openai_object(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": CREATED,
            "owned_by": "dwarfstar",
            "name": self.display_name,
            "context_length": self.ctx,
            "top_provider": {"context_length": self.ctx, "max_completion_tokens": self.ctx, "is_moderated": False},
            "supported_parameters": SUPPORTED_PARAMETERS,
        }

    def anthropic_object(self, name: str) -> dict[str, Any]:
        return {"type": "model", "id": name, "display_name": self.display_name, "created_at": "2026-01-01T00:00:00Z"}
