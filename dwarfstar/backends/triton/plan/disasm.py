"""What a compiled kernel's machine code says: its main loop, the instructions in it, its loads.

NVIDIA: the SASS that cuobjdump prints, one instruction per `/*addr*/` line; a loop is a backward
branch (`BRA` to a lower address). AMD: the AMDGCN assembly Triton keeps, whose basic blocks carry
LLVM's loop annotations (`; =>This Inner Loop Header: Depth=N`, `; in Loop: Header=BB0_3 Depth=N`).
The main loop is the innermost loop that loads the most bytes from global memory per pass: the K
loop of a GEMV, the row loop of attention; a kernel whose programs take different branches has more
(`Code.loops`: innermost loops by bytes loaded per pass, most first). Counts are per warp (wavefront)
and per pass through the loop body as compiled (a loop the assembler unrolled covers several source
iterations per pass).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Body:
    """Instructions of a straight run of code: a loop body, or the whole kernel."""

    instructions: int = 0
    global_loads: int = 0
    load_bytes: int = 0  # per lane: what one pass loads from global memory, each lane's share
    widths: Counter = field(default_factory=Counter)  # bytes per lane of each global load -> count
    shuffles: int = 0
    barriers: int = 0
    shared: int = 0  # shared-memory (LDS) loads and stores
    finishing: bool = False  # after the launch's ticket (`runtime.last_program`): the finishing program's

    def add(self, op: str, load_width: int, kind: str) -> None:
        self.instructions += 1
        if load_width:
            self.global_loads += 1
            self.load_bytes += load_width
            self.widths[load_width] += 1
        if kind:
            setattr(self, kind, getattr(self, kind) + 1)


@dataclass
class Code:
    """A compiled kernel's code: the whole of it, and its innermost loops, the most global bytes
    loaded per pass first (then the longest)."""

    total: Body
    loops: list[Body]

    @property
    def loop(self) -> Body | None:
        """The main loop (None where the kernel has no loop)."""
        return self.loops[0] if self.loops else None


# -- NVIDIA SASS ----------------------------------------------------------------------------------------
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_SASS_BRANCH = re.compile(r"0x([0-9a-f]+)")
_SASS_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def _sass_kind(op: str) -> tuple[int, str]:
    """(global-load bytes per lane, counter name) of a SASS opcode."""
    base, *mods = op.split(".")
    if base in ("LDG", "LDGSTS"):
        return next((_SASS_WIDTH[m] for m in mods if m in _SASS_WIDTH), 4), ""
    if base == "SHFL":
        return 0, "shuffles"
    if base == "BAR":
        return 0, "barriers"
    if base in ("LDS", "STS", "LDSM"):
        return 0, "shared"
    return 0, ""


def parse_sass(sass: str) -> Code:
    ops: list[tuple[int, str, str]] = []
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    # the first global atomic is the ticket that picks a launch's finishing program: loops after it
    # run in that program alone (a split combine, the slots' sum), never as a main loop
    ticket = next((addr for addr, op, _ in ops if op.startswith(("ATOMG", "RED"))), None)
    for addr, op, rest in ops:
        if op.startswith("BRA"):
            target = _SASS_BRANCH.search(rest)
            if target and int(target.group(1), 16) < addr:
                loops.append((int(target.group(1), 16), addr))
    innermost = [(lo, hi) for lo, hi in loops if not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in loops)]

    def body(lo: int, hi: int) -> Body:
        run = Body(finishing=ticket is not None and lo > ticket)
        for addr, op, _ in ops:
            if lo <= addr <= hi:
                run.add(op, *_sass_kind(op))
        return run

    total = body(0, ops[-1][0]) if ops else Body()
    return Code(total, _ranked(body(lo, hi) for lo, hi in innermost))


# -- NVIDIA PTX: the order of a dependent launch's wait and its first read ------------------------------
def waits_before_reading(ptx: str) -> bool:
    """Whether a kernel launched as a programmatic dependent (`runtime.dependent_launch`) waits for the
    kernel before (griddepcontrol.wait) ahead of its first global load or atomic."""
    wait = ptx.find("griddepcontrol.wait")
    reads = [at for at in (ptx.find("ld.global"), ptx.find("atom.global")) if at >= 0]
    return wait >= 0 and all(wait < at for at in reads)


# -- AMD AMDGCN --------------------------------------------------------------------------------------------
_GCN_BLOCK = re.compile(r"^(?:\.L(BB\d+_\d+)|; %bb\.\d+):")  # a labelled block, or a fall-through one
_GCN_HEADER = re.compile(r"Loop Header: Depth=\d+")
_GCN_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+)")
_GCN_WIDTH = {"dwordx4": 16, "b128": 16, "dwordx3": 12, "b96": 12, "dwordx2": 8, "b64": 8, "dword": 4, "b32": 4}


def _gcn_kind(op: str) -> tuple[int, str]:
    if op.startswith(("global_load", "buffer_load", "flat_load")):
        suffix = op.split("_", 2)[-1]
        return _GCN_WIDTH.get(suffix, 2 if "short" in suffix or "16" in suffix else 1), ""
    if op.startswith("ds_"):
        return 0, "shuffles" if op.startswith(("ds_swizzle", "ds_bpermute", "ds_permute")) else "shared"
    if op == "s_barrier":
        return 0, "barriers"
    return 0, ""


def parse_amdgcn(asm: str) -> Code:
    total, loops = Body(), {}
    header: str | None = None  # the innermost loop the current block belongs to
    for line in asm.splitlines():
        m = _GCN_BLOCK.match(line)
        if m:
            inside = _GCN_IN_LOOP.search(line)
            header = m.group(1) if _GCN_HEADER.search(line) else inside.group(1) if inside else None
            if header:
                loops.setdefault(header, Body())
            continue
        text = line.strip()
        if not text or text[0] in ".;" or text.endswith(":"):
            continue
        op = text.split()[0]
        if not re.match(r"^[svgbdf][a-z0-9_]*$", op):
            continue
        kind = _gcn_kind(op)
        total.add(op, *kind)
        if header:
            loops[header].add(op, *kind)
    # each block counts in its innermost loop only, so every loop's body is its own code
    return Code(total, _ranked(loops.values()))


def _ranked(bodies) -> list[Body]:
    """Loops by global bytes loaded per pass, then length, the most first."""
    return sorted(bodies, key=lambda b: (b.load_bytes, b.instructions), reverse=True)


def parse(kernel, backend: str) -> Code:
    """The code of a compiled Triton kernel for `backend` ("cuda" or "hip")."""
    if backend == "cuda":
        from dwarfstar.backends.triton.plan.target import cuda_sass

        return parse_sass(cuda_sass(kernel.asm["cubin"]))
    return parse_amdgcn(kernel.asm["amdgcn"])
