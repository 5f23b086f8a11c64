"""The model shipped inside the package: the default `-m` of `dwarfstar run` and `dwarfstar serve`.

A DeepSeek V4 nano model (hidden 96, 6 layers in the Flash pattern, the full 129,280-id vocabulary)
trained on I promessi sposi by tools/train_nano.py, so the first command works with no download.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUNDLED_MODEL = "nano.gguf"


def default_model_path() -> Path:
    return Path(str(resources.files("dwarfstar") / "data" / BUNDLED_MODEL))
