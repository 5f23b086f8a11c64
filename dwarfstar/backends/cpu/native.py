"""The CPU kernels (kernels.c), compiled at first use with the machine's C compiler and loaded with ctypes.

The build is `cc -O3 -march=native -ffp-contract=off -fopenmp -shared` (OpenMP dropped where the compiler
lacks it). `-ffp-contract=off` keeps each C `a * b + c` two roundings. GCC's default fuses such pairs into
FMAs where its vectorizer sees fit (89 of them in this AVX2 machine's portable build), which differed
between the token-count copies of a row's loop, so a row's last bit depended on what shared the call.
The AVX2 form writes its FMAs as intrinsics, which the flag leaves as they are. The library is kept
under the user cache folder, keyed by the source, the flags, the compiler's version and the CPU's
features, so a second run loads it at once and another machine builds its own. Where no compiler
works, `kernels()` says why and the CPU backend falls back to the reference's float32 products
(`dwarfstar.backends.cpu.matrix.native_or_none`): slower, never wrong, and said once on stderr.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
SCALAR = ("-DDS_SCALAR",)  # the portable C form, also built where AVX2 exists (tests compare the two)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class KernelBuildError(RuntimeError):
    """No C compiler could build kernels.c here."""


def cache_dir() -> Path:
    base = os.environ.get("DWARFSTAR_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dwarfstar" / "cpu-kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC, or install gcc or clang)")
    return cc


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(cc: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    errors = []
    for openmp in (("-fopenmp",), ()):  # Apple clang has no OpenMP: single-threaded kernels then
        done = subprocess.run([cc, *flags, *openmp, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent first uses each build, one file wins whole
            return
        errors.append(done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"])
    os.unlink(tmp)
    raise KernelBuildError(f"{cc} could not build {SOURCE.name}: {errors[0][0]}")


def _signature(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.ds_quantize.argtypes = [_P, _I64, _I64, ctypes.c_int, _P, _P, _P]
    lib.ds_quantize.restype = None
    lib.ds_matmul.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, ctypes.c_int]
    lib.ds_matmul.restype = None
    lib.ds_set_iq2xxs_grid.argtypes = [_P]
    lib.ds_set_iq2xxs_grid.restype = None
    lib.ds_simd.restype = ctypes.c_int
    return lib


def _iq2xxs_grid() -> bytes:
    """ggml's IQ2_XXS grid as 256 little-endian words of eight magnitudes, from the pinned gguf package."""
    import numpy as np
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    return np.asarray(IQ2_XXS.grid, dtype=np.uint8).reshape(256, 8).tobytes()


@functools.cache
def kernels(scalar: bool = False) -> ctypes.CDLL:
    """The compiled kernels (built on first use); `scalar` asks for the portable C form."""
    cc = _compiler()
    flags = FLAGS + (SCALAR if scalar else ())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_features(), platform.machine()]).encode()
    ).hexdigest()[:16]
    path = cache_dir() / f"kernels-{key}.so"
    if not path.exists():
        try:
            _build(cc, flags, path)
        except OSError:  # no cache folder can be made (a read-only home): the temporary folder instead
            path = Path(tempfile.gettempdir()) / f"dwarfstar-cpu-kernels-{os.getuid()}" / path.name
            if not path.exists():
                _build(cc, flags, path)
    lib = _signature(ctypes.CDLL(str(path)))
    grid = _iq2xxs_grid()
    lib.ds_set_iq2xxs_grid(ctypes.c_char_p(grid))
    return lib


@functools.cache
def available() -> str | None:
    """None where the kernels load, else why not (said once on stderr)."""
    try:
        kernels()
    except (KernelBuildError, OSError) as exc:
        print(f"dwarfstar: CPU kernels unavailable ({exc}); products run in torch float32", file=sys.stderr)
        return str(exc)
    return None
