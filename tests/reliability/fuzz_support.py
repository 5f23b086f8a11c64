"""Shared pieces of the fuzz targets: how many inputs each tries, byte mutations, outcome tallies.

The suite runs a quick subset (DWARFSTAR_FUZZ_EXAMPLES unset: a few dozen inputs per target);
`nox -s reliability` sets it to 10,000 and prints each target's tally.
"""

from __future__ import annotations

import atexit
import os
import struct
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("DWARFSTAR_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    # the suite's subset draws the same inputs every run (a fuzz finding belongs to the long runs,
    # not to a random CI failure); the long runs draw new ones each time
    derandomize="DWARFSTAR_FUZZ_EXAMPLES" not in os.environ,
    deadline=None,
    database=None,  # every run starts fresh: the figures count inputs tried, not replays
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

TALLIES: dict[str, Counter] = {}


def tally(target: str, outcome: str) -> None:
    TALLIES.setdefault(target, Counter())[outcome] += 1


@atexit.register
def _report() -> None:
    for target, counts in sorted(TALLIES.items()):
        outcomes = ", ".join(f"{n} {what}" for what, n in counts.most_common())
        print(f"fuzz {target}: {sum(counts.values())} inputs: {outcomes}")


# values that break length and offset arithmetic: zero, one, sign bits, all ones, just past 32 bits
EDGE_U64 = [0, 1, 2, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated(draw, data: bytes, hot: int | None = None) -> bytes:
    """`data` with a few edits: flipped bytes, overwritten integers (edge values), a cut, an insert,
    a deleted run. Offsets favour the first `hot` bytes (headers and tables) when given."""
    out = bytearray(data)

    def offset() -> int:
        limit = len(out) if hot is None or draw(st.booleans()) else min(hot, len(out))
        return draw(st.integers(0, max(0, limit - 1)))

    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "u32", "u64", "cut", "insert", "delete"]))
        if not out:
            break
        at = offset()
        if op == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op in ("u32", "u64"):
            size = 4 if op == "u32" else 8
            value = draw(st.sampled_from(EDGE_U64)) % (1 << (8 * size))
            out[at : at + size] = struct.pack("<I" if size == 4 else "<Q", value)[: len(out) - at]
        elif op == "cut":
            del out[at:]
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del out[at : at + draw(st.integers(1, 64))]
    return bytes(out)
