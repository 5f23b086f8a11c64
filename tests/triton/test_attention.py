"""Sink attention over window + compressed rows (+ inverse RoPE) against the reference ops."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import attention as at
from dwarfstar.backends.triton.runtime import PagedRows
from dwarfstar.model.numerics import rope_angles

HEADS, DIM, ROPE, WINDOW = 4, 128, 32, 8


def setup(t, n_prev, n_comp, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, HEADS, DIM, generator=gen).to(device)
    window_rows = torch.randn(n_prev + t, DIM, generator=gen).to(device)
    comp = torch.randn(max(n_comp, 1), DIM, generator=gen).to(device)
    sinks = (0.5 * torch.randn(HEADS, generator=gen)).to(device)
    inv = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    return q, window_rows, comp, sinks, inv.to(device)


def angles_at(p0, t, inv, device):
    return tuple(a.to(device) for a in rope_angles(torch.arange(p0, p0 + t), inv.cpu()))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("p0,t", [(0, 5), (3, 1), (20, 6), (40, 1)])  # window not yet full / full
def test_window_only(p0, t, split, device):
    n_prev = min(p0, WINDOW)
    q, rows, _, sinks, inv = setup(t, n_prev, 0, device, seed=p0)
    cs = angles_at(p0, t, inv, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    got = at.attention(q, rows, n_prev, WINDOW, sinks, inv, ROPE, pos, split=split)
    torch.testing.assert_close(got, at.reference(q, rows, n_prev, WINDOW, sinks, cs, p0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 2])
def test_all_visible_compressed_rows_at_a_boundary(split, device):
    """Ratio 4 without indexer selection: the query at p = 15 sees row 3, which it completes itself."""
    p0, t, ratio = 12, 4, 4
    q, rows, comp, sinks, inv = setup(t, WINDOW, 6, device, seed=1)
    cs = angles_at(p0, t, inv, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    paged = PagedRows.scattered(comp)
    got = at.attention(q, rows, WINDOW, WINDOW, sinks, inv, ROPE, pos, comp_rows=paged, ratio=ratio, split=split)
    want = at.reference(q, rows, WINDOW, WINDOW, sinks, cs, p0, comp_rows=comp, ratio=ratio)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [2, 3, 5, 8])
def test_splits_merge_up_a_tree(split, device):
    """Key blocks dealt over 2 to 8 splits, every split holding some (a query at p = 399 sees 100
    compressed rows, 7 blocks, and its window's): the splits merge pairwise over up to three levels,
    a sibling missing at some level where the count is no power of two. The reference's result, one
    split's within rounding, the same bits at a second launch, and every ticket back at zero."""
    p0, ratio, n_comp = 399, 4, 100
    q, rows, comp, sinks, inv = setup(1, WINDOW, n_comp, device, seed=12)
    cs = angles_at(p0, 1, inv, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    paged = PagedRows.scattered(comp)
    args = (q, rows, WINDOW, WINDOW, sinks, inv, ROPE, pos)
    got = at.attention(*args, comp_rows=paged, ratio=ratio, split=split)
    want = at.reference(q, rows, WINDOW, WINDOW, sinks, cs, p0, comp_rows=comp, ratio=ratio)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, at.attention(*args, comp_rows=paged, ratio=ratio, split=1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got, at.attention(*args, comp_rows=paged, ratio=ratio, split=split))
    assert not at.ticket_counters(q.device, "attention", 1).any()


@pytest.mark.parametrize("split", [1, 2])
def test_selected_rows_with_padding(split, device):
    p0, t = 30, 3
    q, rows, comp, sinks, inv = setup(t, WINDOW, 7, device, seed=2)
    selected = torch.tensor([[0, 3, 5, -1], [6, 1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32, device=device)
    cs = angles_at(p0, t, inv, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    paged = PagedRows.scattered(comp)
    got = at.attention(q, rows, WINDOW, WINDOW, sinks, inv, ROPE, pos, comp_rows=paged, selected=selected, split=split)
    want = at.reference(q, rows, WINDOW, WINDOW, sinks, cs, p0, comp_rows=comp, selected=selected)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fast_precision_stays_close(device):
    from dwarfstar.backends.triton.runtime import FAST

    q, rows, comp, sinks, inv = setup(2, WINDOW, 5, device, seed=3)
    cs = angles_at(50, 2, inv, device)
    pos = torch.tensor([50], dtype=torch.int32, device=device)
    paged = PagedRows.scattered(comp)
    got = at.attention(q, rows, WINDOW, WINDOW, sinks, inv, ROPE, pos, comp_rows=paged, ratio=128, precision=FAST)
    want = at.reference(q, rows, WINDOW, WINDOW, sinks, cs, 50, comp_rows=comp, ratio=128)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 1e-6 < err < 3e-2


def test_split_none_chooses_from_the_device(device):
    """split=None: the decode rows are spread over the device's multiprocessors, and the result holds."""
    p0 = 40
    q, rows, comp, sinks, inv = setup(1, WINDOW, 12, device, seed=4)  # rows 0..9 visible at p = 40
    cs = angles_at(p0, 1, inv, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    paged = PagedRows.scattered(comp)
    got = at.attention(q, rows, WINDOW, WINDOW, sinks, inv, ROPE, pos, comp_rows=paged, ratio=4, split=None)
    want = at.reference(q, rows, WINDOW, WINDOW, sinks, cs, p0, comp_rows=comp, ratio=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_split_covers_the_multiprocessors(monkeypatch):
    monkeypatch.setattr(at, "multiprocessors", lambda device: 132)  # as runtime.assume_multiprocessors(132)
    cpu = torch.device("cpu")
    assert at.decode_split(cpu, t=1, groups=4, row_blocks=1000) == 64  # 4 * 64 programs >= 132 SMs
    assert at.decode_split(cpu, t=1, groups=8, row_blocks=1000) == 32
    assert at.decode_split(cpu, t=1, groups=4, row_blocks=10) == 8  # no more splits than key blocks
    assert at.decode_split(cpu, t=64, groups=4, row_blocks=1000) == 1  # prefill fills the device alone


def gathered_window(ring: torch.Tensor, p: int) -> torch.Tensor:
    """The ring rows of positions max(0, p - W + 1) .. p, oldest first (position q in row q mod W)."""
    return ring[torch.arange(max(0, p - WINDOW + 1), p + 1) % WINDOW]


@pytest.mark.parametrize("kind", ["window", "all rows", "selected"])
def test_a_batch_of_sequences_in_cache_slots_matches_each_alone(kind, device):
    """One launch for three sequences, each at its own position in its own slot of a cache block:
    inside the raw window (p = 3), just past a ratio-4 boundary with the ring wrapped (p = 20), and
    further on (p = 43). Each output equals the chunk kernel's reference on that sequence's rows."""
    gen = torch.Generator().manual_seed(7)
    positions, slots, capacity = [3, 20, 43], [2, 0, 3], 16
    q = torch.randn(3, HEADS, DIM, generator=gen)
    rings = torch.randn(4, WINDOW, DIM, generator=gen)
    comp = torch.randn(4, capacity, DIM, generator=gen)
    sinks = 0.5 * torch.randn(HEADS, generator=gen)
    inv = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    cs = rope_angles(torch.tensor(positions), inv)
    ratio = 0 if kind == "window" else 4
    selected = None
    if kind == "selected":  # per sequence: chosen visible rows, -1 padded (none yet at p = 3)
        selected = torch.tensor([[-1, -1, -1], [4, 0, 2], [10, -1, 7]], dtype=torch.int32)
    pos, slot = (torch.tensor(v, dtype=torch.int32, device=device) for v in (positions, slots))
    got = at.attention_batch(
        q.to(device), rings.to(device), sinks.to(device), inv.to(device), ROPE, pos, slot,
        comp_rows=None if kind == "window" else PagedRows.scattered(comp.to(device)), comp_bound=capacity, ratio=ratio,
        selected=None if selected is None else selected.to(device),
    )  # fmt: skip
    for b, (p, s) in enumerate(zip(positions, slots, strict=True)):
        rows = gathered_window(rings[s], p)
        want = at.reference(
            q[b : b + 1], rows, rows.shape[0] - 1, WINDOW, sinks, (cs[0][b : b + 1], cs[1][b : b + 1]), p,
            comp_rows=None if kind == "window" else comp[s], ratio=ratio,
            selected=None if selected is None else selected[b : b + 1],
        )  # fmt: skip
        torch.testing.assert_close(got[b : b + 1].cpu(), want, rtol=1e-5, atol=1e-5)


def test_batch_kernels_refuse_strided_positions(device):
    """pos[i] and slot[i] are read by plain offsets: an interleaved view would read the wrong words."""
    both = torch.tensor([[0, 0], [5, 1]], dtype=torch.int32, device=device)
    pos, slots = both.unbind(1)  # strided: the mistake this guards against
    q, rings = torch.zeros(2, HEADS, DIM, device=device), torch.zeros(2, WINDOW, DIM, device=device)
    inv = torch.ones(ROPE // 2, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        at.attention_batch(q, rings, torch.zeros(HEADS, device=device), inv, ROPE, pos, slots)


@pytest.mark.parametrize("kind", ["all rows", "selected"])
def test_compact_rows_read_as_their_float32_values(kind, device):
    """A compact cache's compressed rows (`SplitRows`: the bf16-exact leading dims in bf16, the RoPE
    dims in float32) give the batch kernel exactly the output of the same values stored whole."""
    gen = torch.Generator().manual_seed(8)
    positions, slots, capacity, exact = [9, 30], [1, 0], 16, DIM - ROPE
    q = torch.randn(2, HEADS, DIM, generator=gen)
    rings = torch.randn(2, WINDOW, DIM, generator=gen)
    comp = torch.randn(2, capacity, DIM, generator=gen)
    comp[..., :exact] = comp[..., :exact].bfloat16().float()  # what QAT rounding guarantees
    split = PagedRows.scattered(comp.to(device), exact_dims=exact)
    sinks = 0.5 * torch.randn(HEADS, generator=gen)
    inv = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    selected = torch.tensor([[1, 0, -1], [6, 2, 5]], dtype=torch.int32, device=device) if kind == "selected" else None
    pos, slot = (torch.tensor(v, dtype=torch.int32, device=device) for v in (positions, slots))
    common = dict(comp_bound=capacity, ratio=4, selected=selected)
    args = (q.to(device), rings.to(device), sinks.to(device), inv.to(device), ROPE, pos, slot)
    whole = at.attention_batch(*args, comp_rows=PagedRows.scattered(comp.to(device)), **common)
    assert torch.equal(at.attention_batch(*args, comp_rows=split, **common), whole)
    chunk = dict(ratio=4, selected=None if selected is None else selected[:1])
    rows = gathered_window(rings[slots[0]], positions[0]).to(device)
    one = (q[:1].to(device), rows, rows.shape[0] - 1, WINDOW, sinks.to(device), inv.to(device), ROPE, pos[:1])
    assert torch.equal(
        at.attention(*one, comp_rows=PagedRows(split.pool, split.table[slots[0]]), **chunk),
        at.attention(*one, comp_rows=PagedRows.scattered(comp[slots[0]].to(device)), **chunk),
    )


@pytest.mark.parametrize("selection", [False, True])
def test_rows_across_pages_in_any_order(selection, device):
    """176 visible rows of a ratio-4 layer at p = 703 span three pages of the pool, laid out in a
    shuffled order (as forks leave them): the chunk and batch kernels read each row through its
    page table, and equal the reference on the same rows kept contiguous."""
    p0, n_comp = 703, 180
    q, rows, comp, sinks, inv = setup(1, WINDOW, n_comp, device, seed=9)
    cs = angles_at(p0, 1, inv, device)
    pos = torch.tensor([p0], dtype=torch.int32, device=device)
    # rows at both ends of every page, and past a page's end, in a scrambled order
    picks = [0, 63, 64, 127, 128, 175, 100, 5] if selection else None
    selected = None if picks is None else torch.tensor([picks], dtype=torch.int32, device=device)
    common = dict(ratio=4, selected=selected)
    want = at.reference(q, rows, WINDOW, WINDOW, sinks, cs, p0, comp_rows=comp, **common)
    paged = PagedRows.scattered(comp, seed=5)
    assert paged.table.tolist() != sorted(paged.table.tolist())  # pages out of order
    got = at.attention(q, rows, WINDOW, WINDOW, sinks, inv, ROPE, pos, comp_rows=paged, split=2, **common)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    block = PagedRows.scattered(torch.stack((torch.zeros_like(comp), comp)), seed=6)  # the sequence in slot 1
    ring = torch.zeros(2, WINDOW, DIM, device=device)
    ring[1, torch.arange(p0 - WINDOW + 1, p0 + 1) % WINDOW] = rows[1:]
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    got = at.attention_batch(q, ring, sinks, inv, ROPE, pos, slot, comp_rows=block, comp_bound=256, **common)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_splits_are_combined_by_the_last_to_finish(monkeypatch, device):
    """With several splits per (sequence, head group) the program that draws the last ticket combines
    them: the output equals one split's, and the counters are back at zero, so a second launch (a
    graph replay) combines again."""
    monkeypatch.setattr(at, "multiprocessors", lambda device: 64)  # 2 sequences x 1 group x 32 splits wanted
    gen = torch.Generator().manual_seed(11)
    positions, slots, capacity = [40, 700], [1, 0], 256
    q = torch.randn(2, HEADS, DIM, generator=gen).to(device)
    rings = torch.randn(2, WINDOW, DIM, generator=gen).to(device)
    comp = PagedRows.scattered(torch.randn(2, capacity, DIM, generator=gen).to(device), seed=3)
    sinks = (0.5 * torch.randn(HEADS, generator=gen)).to(device)
    inv = (10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)).to(device)
    pos, slot = (torch.tensor(v, dtype=torch.int32, device=device) for v in (positions, slots))
    args = (q, rings, sinks, inv, ROPE, pos, slot, comp, capacity, 128)
    first, again = at.attention_batch(*args), at.attention_batch(*args)
    tickets = at.ticket_counters(q.device, "attention", 1)
    assert not tickets.any()
    assert torch.equal(first, again)
    monkeypatch.setattr(at, "multiprocessors", lambda device: 1)  # one split: no combine
    torch.testing.assert_close(first, at.attention_batch(*args), rtol=1e-5, atol=1e-5)
    for b, (p, s) in enumerate(zip(positions, slots, strict=True)):
        rows = gathered_window(rings[s].cpu(), p)
        cs = rope_angles(torch.tensor([p]), inv.cpu())
        want = at.reference(q[b : b + 1].cpu(), rows, rows.shape[0] - 1, WINDOW, sinks.cpu(), cs, p,
                            comp_rows=comp.pool[comp.table[s].long()].flatten(0, 1).cpu(), ratio=128)  # fmt: skip
        torch.testing.assert_close(first[b : b + 1].cpu(), want, rtol=1e-5, atol=1e-5)
