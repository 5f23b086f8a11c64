"""`common_prefix_len` (slice comparison) against the definition, token by token."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dwarfstar.session.prefix import FIRST_RUN, common_prefix_len


def by_definition(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


tokens = st.lists(st.integers(0, 3), max_size=40)


@given(shared=st.lists(st.integers(0, 129279), max_size=3 * FIRST_RUN), a=tokens, b=tokens)
def test_matches_the_definition(shared, a, b):
    left, right = shared + a, shared + b
    assert common_prefix_len(left, right) == by_definition(left, right)
    assert common_prefix_len(right, left) == by_definition(left, right)


def test_mismatch_at_every_position_of_a_long_prefix():
    base = list(range(5000))
    for k in (0, 1, 255, 256, 257, 767, 768, 1791, 1792, 4999):
        other = base[:k] + [-1] + base[k + 1 :]
        assert common_prefix_len(base, other) == k
    assert common_prefix_len(base, base[:3000]) == 3000
    assert common_prefix_len(base, list(base)) == 5000
    assert common_prefix_len([], base) == 0


def test_accepts_any_int_sequences():
    assert common_prefix_len((1, 2, 3), [1, 2, 4]) == 2
    assert common_prefix_len(range(10), [0, 1, 2]) == 3


@given(shared=st.lists(st.integers(0, 129279), max_size=600), a=tokens, b=tokens)
def test_integer_arrays_match_the_definition(shared, a, b):
    left, right = shared + a, shared + b
    assert common_prefix_len(np.array(left, np.int32), np.array(right, np.int32)) == by_definition(left, right)
