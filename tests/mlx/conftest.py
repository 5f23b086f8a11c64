"""A CPU emulation of the Metal kernels, so they are executed and checked where Metal is missing.

The kernel sources (dwarfstar/backends/mlx/kernels) are written to be valid C++ as well as Metal.
`emulate` compiles a kernel with a small shim (address-space keywords erased, `half` as _Float16,
threadgroup arrays as statics) and runs a launch's whole grid: one threadgroup at a time, each of
its threads a fiber, so simd_sum and threadgroup barriers synchronise the way the GPU's do. It
checks the decoding, indexing, tiling and launch geometry; it cannot check Metal-only properties
(the Metal compiler's acceptance, speed), which tools/apple_check.sh covers on a Mac.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dwarfstar.backends.mlx import metal
from dwarfstar.model.loader import ModelFile, open_model
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

_CTYPES = {np.uint8: "uint8_t", np.float32: "float", np.uint32: "uint32_t", np.int32: "int32_t"}
_ATTRIBUTES = (
    ("uint3", "thread_position_in_grid", "LANE.grid_pos"),
    ("uint3", "threadgroup_position_in_grid", "LANE.group_pos"),
    ("uint", "thread_index_in_threadgroup", "LANE.index"),
    ("uint", "thread_index_in_simdgroup", "LANE.lane"),
)

# The kernel-independent runtime, compiled once. Threadgroups run one at a time; their threads are
# cooperative fibers (ucontext), switched whenever one waits at simd_sum or a threadgroup barrier,
# so lanes meet there exactly as on the GPU, at a fraction of the cost of OS threads.
_RUNTIME = r"""
#include <ucontext.h>
#include <vector>
#define EMULATION_RUNTIME  // keeps `thread` a keyword here
#include "shim.h"

thread_local Lane LANE;

namespace {
constexpr size_t STACK = 64 * 1024;

struct Fiber {
  ucontext_t context;
  Lane lane;
  bool done;
  std::vector<char> stack;
};

struct Barrier {
  uint expected = 0, arrived = 0, generation = 0;
};

ucontext_t scheduler;
Fiber* current = nullptr;
void (*kernel)(void*) = nullptr;
void* arguments = nullptr;
Barrier group_barrier;
std::vector<Barrier> simd_barriers;
std::vector<float> simd_values;

void yield() { swapcontext(&current->context, &scheduler); }

void arrive(Barrier& b) {
  const uint generation = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    b.generation++;
    return;
  }
  while (b.generation == generation) yield();
}

void fiber_entry() {
  kernel(arguments);
  current->done = true;
}
}  // namespace

namespace metal {
void threadgroup_barrier(mem_flags) { arrive(group_barrier); }
float simd_sum(float v) {
  simd_values[LANE.index] = v;
  arrive(simd_barriers[LANE.simdgroup]);
  float total = 0.0f;
  const uint first = LANE.simdgroup * 32;
  for (uint i = first; i < first + 32 && i < simd_values.size(); i++) total += simd_values[i];
  arrive(simd_barriers[LANE.simdgroup]);
  return total;
}
}  // namespace metal

void launch(uint3 grid, uint3 tg, void (*body)(void*), void* context) {
  kernel = body;
  arguments = context;
  const uint size = tg.x * tg.y * tg.z;
  std::vector<Fiber> fibers(size);
  for (auto& f : fibers) f.stack.resize(STACK);
  for (uint gz = 0; gz * tg.z < grid.z; gz++)
  for (uint gy = 0; gy * tg.y < grid.y; gy++)
  for (uint gx = 0; gx * tg.x < grid.x; gx++) {
    uint live = 0;
    simd_barriers.assign((size + 31) / 32, Barrier{});
    simd_values.assign(size, 0.0f);
    for (uint tz = 0; tz < tg.z; tz++)
    for (uint ty = 0; ty < tg.y; ty++)
    for (uint tx = 0; tx < tg.x; tx++) {
      uint3 pos{gx * tg.x + tx, gy * tg.y + ty, gz * tg.z + tz};
      if (pos.x >= grid.x || pos.y >= grid.y || pos.z >= grid.z) continue;
      uint index = tx + tg.x * (ty + tg.y * tz);
      Fiber& f = fibers[live++];
      f.lane = Lane{pos, uint3{gx, gy, gz}, index, index % 32, index / 32};
      f.done = false;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.data();
      f.context.uc_stack.ss_size = STACK;
      f.context.uc_link = &scheduler;
      makecontext(&f.context, fiber_entry, 0);
      simd_barriers[index / 32].expected++;
    }
    group_barrier = Barrier{live, 0, 0};
    for (bool running = true; running;) {
      running = false;
      for (uint i = 0; i < live; i++) {
        if (fibers[i].done) continue;
        running = true;
        current = &fibers[i];
        LANE = current->lane;
        swapcontext(&scheduler, &current->context);
      }
    }
  }
}
"""

# What a kernel sees: Metal's types and builtins, and the address-space keywords erased.
_SHIM = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef _Float16 half;
struct uint3 { uint x, y, z; };

template <typename T, typename U>
T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U));
  T t;
  std::memcpy(&t, &u, sizeof t);
  return t;
}

struct Lane { uint3 grid_pos, group_pos; uint index, lane, simdgroup; };
extern thread_local Lane LANE;
void launch(uint3 grid, uint3 tg, void (*body)(void*), void* context);

namespace metal {
enum class mem_flags { mem_threadgroup };
inline uint popcount(uint x) { return __builtin_popcount(x); }
void threadgroup_barrier(mem_flags);
float simd_sum(float v);
}  // namespace metal

#ifndef EMULATION_RUNTIME
#define device
#define constant
#define thread
#define threadgroup
#endif
"""


def _program(spec: metal.KernelSpec, launch: metal.Launch, arrays: list[np.ndarray]) -> str:
    header = "\n".join(line for line in metal.header(spec).splitlines() if not line.startswith("#include"))
    # threadgroup arrays are shared by a group's threads: statics, as groups run one at a time
    body = re.sub(r"\bthreadgroup\s+(\w+)\s+(\w+)\s*\[", r"static \1 \2[", spec.source)
    names = [name for name, _ in launch.template]
    params = [f"const {_CTYPES[a.dtype.type]}* {n}" for n, a in zip(spec.inputs, arrays, strict=True)]
    params += [f"float* {n}" for n in spec.outputs]
    params += [f"{ctype} {name}" for ctype, name, _ in _ATTRIBUTES]
    args = [f"a.in{i}" for i in range(len(arrays))] + ["a.out"] + [value for *_, value in _ATTRIBUTES]
    values = ", ".join(str(v) for _, v in launch.template)
    ctypes = [_CTYPES[a.dtype.type] for a in arrays]
    fields = " ".join(f"{c}* in{i};" for i, c in enumerate(ctypes))
    loads = " ".join(f"a.in{i} = static_cast<{c}*>(read_file(argv[{i + 1}]));" for i, c in enumerate(ctypes))
    t = metal.THREADGROUP
    n = len(arrays)
    return f"""#include "shim.h"
{header}
template <{", ".join(f"int {n}" for n in names)}>
void kernel_body({", ".join(params)}) {{
{body}
}}

static void* read_file(const char* path) {{
  FILE* f = std::fopen(path, "rb");
  std::fseek(f, 0, SEEK_END);
  long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  void* data = std::malloc(n + 16);
  if (n && std::fread(data, 1, n, f) != size_t(n)) std::abort();
  std::fclose(f);
  return data;
}}

struct Args {{ {fields} float* out; }};

static void run(void* context) {{
  Args& a = *static_cast<Args*>(context);
  kernel_body<{values}>({", ".join(args)});
}}

int main(int argc, char** argv) {{
  Args a;
  {loads}
  // the grid and the output size are arguments, so one binary serves every launch of a kernel
  uint3 grid{{uint(std::atol(argv[{n + 2}])), uint(std::atol(argv[{n + 3}])), uint(std::atol(argv[{n + 4}]))}};
  const size_t n_out = std::atol(argv[{n + 5}]);
  a.out = static_cast<float*>(std::calloc(n_out, sizeof(float)));
  launch(grid, uint3{{{t[0]}, {t[1]}, {t[2]}}}, run, &a);
  FILE* f = std::fopen(argv[{n + 1}], "wb");
  std::fwrite(a.out, sizeof(float), n_out, f);
  std::fclose(f);
  return 0;
}}
"""


@pytest.fixture(scope="session")
def emulate(tmp_path_factory) -> Callable[[metal.Launch], np.ndarray]:
    """run(launch) -> the kernel's output, computed by the CPU emulation (skips without a C++ compiler)."""
    if mx.metal.is_available():
        pytest.skip("Metal is present: the real kernels are checked instead (the *_on_metal tests)")
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++: the CPU emulation of the Metal kernels needs a C++20 compiler")
    work: Path = tmp_path_factory.mktemp("metal-emulation")
    (work / "shim.h").write_text(_SHIM)
    (work / "runtime.cpp").write_text(_RUNTIME)
    flags = ["-std=c++20", "-O1", "-pthread", "-w", f"-I{work}"]
    subprocess.run([compiler, *flags, "-c", str(work / "runtime.cpp"), "-o", str(work / "runtime.o")], check=True)

    def run(launch: metal.Launch) -> np.ndarray:
        spec = metal.SPECS[launch.kernel]
        arrays = [np.array(a) for a in launch.inputs]
        source = _program(spec, launch, arrays)
        key = hashlib.sha1(source.encode()).hexdigest()[:16]
        binary = work / key
        if not binary.exists():
            (work / f"{key}.cpp").write_text(source)
            subprocess.run(
                [compiler, *flags, str(work / f"{key}.cpp"), str(work / "runtime.o"), "-o", str(binary)],
                check=True,
            )
        paths = []
        for i, a in enumerate(arrays):
            paths.append(work / f"{key}.in{i}")
            np.ascontiguousarray(a).tofile(paths[-1])
        out = work / f"{key}.out"
        n_out = int(np.prod(launch.output_shape))
        subprocess.run([str(binary), *map(str, paths), str(out), *map(str, launch.grid), str(n_out)], check=True)
        return np.fromfile(out, dtype=np.float32).reshape(launch.output_shape)

    return run


@pytest.fixture
def metal_device() -> None:
    """Skip, with the reason, where the real kernels cannot run."""
    if not mx.metal.is_available():
        pytest.skip("no Metal device: the kernels compile and run only on Apple silicon (tools/apple_check.sh)")


@pytest.fixture(scope="session")
def ds4_model(tmp_path_factory) -> ModelFile:
    """TINY_K in the ds4 layout: Q8_0 projections, IQ2_XXS gate/up and Q2_K down experts (random blocks)."""
    path = tmp_path_factory.mktemp("models") / "tiny-k-ds4.gguf"
    write_synthetic_model(path, TINY_K, layout="ds4", seed=0)
    return open_model(path)
