"""Paged compressed rows: which page of a cache block's row pool holds each slot's rows, and who shares it.

A sequence's compressed rows are append-only: once a window is pooled its row never changes (a
rewind, and only a rewind, lets the sequence write rows below its end again). So a fork, the copy a
server makes when a subagent's prompt shares the main conversation's prefix, need not copy them: it
points its page table at its parent's pages and each page counts its holders. A holder that writes
into a page others hold first takes a page of its own with the same contents (copy on write). The
rows a fork shares therefore exist once, however many forks read them, and a fork costs a page
table, not a context's rows.

Rows are kept in pages of `PAGE_ROWS` rows. A page of ratio-4 rows spans 256 tokens, one of
ratio-128 rows 8,192: a sequence has at most one partly filled page per ratio, so paging wastes
less than a page per ratio. Every layer of a ratio emits the same number of rows, so one page table
per ratio serves all of them (and the attention and indexer rows of a ratio-4 layer): page k of
every such layer's pool belongs to the same slot.

The pool of a block has `slots * pages_per_slot` pages, as many as its tables have entries, so a
page can always be found: each slot's table holds at most `pages_per_slot` pages, shared or not.

`host` is the table the allocator reads (-1: no page yet); `table` is its copy in the backend's
arrays, which kernels read on the device. An entry without a page there holds page 0: a valid
address, read only under a mask (a row past the sequence's end is never visible).
"""

from __future__ import annotations

from typing import Any

import numpy as np

PAGE_ROWS = 64  # rows per page; ROW_STEP, so a slot's capacity is a whole number of pages


class RowPages:
    """The page tables of one cache block for one compress ratio, and its pages' holder counts."""

    def __init__(self, slots: int, pages_per_slot: int, table: Any) -> None:
        """`table`: the backend's int32 array [slots, pages_per_slot], zeroed (`Storage.table`)."""
        self.pages_per_slot = pages_per_slot
        self.host = np.full((slots, pages_per_slot), -1, dtype=np.int64)
        self.table = table
        self.holders = np.zeros(slots * pages_per_slot, dtype=np.int32)
        self.free = list(range(slots * pages_per_slot - 1, -1, -1))  # popped lowest first

    def pages_of(self, slot: int, n_rows: int) -> np.ndarray:
        """The pages holding the slot's first `n_rows` rows (each must have been written)."""
        pages = self.host[slot, : -(-n_rows // PAGE_ROWS)]
        if (pages < 0).any():
            raise AssertionError(f"slot {slot} reads rows below {n_rows} it never wrote")
        return pages

    def locate(self, slot: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page, row in the page) of each of the slot's `rows` (written ones only)."""
        pages = self.host[slot, rows // PAGE_ROWS]
        if (pages < 0).any():
            raise AssertionError(f"slot {slot} has no page for some of rows {rows.min()}..{rows.max()}")
        return pages, rows % PAGE_ROWS

    def make_writable(self, slot: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Give the slot a page of its own under rows lo..hi-1: a new page where it had none, a copy
        where the page is shared. Returns the (shared page, its copy) pairs, whose rows the caller
        copies in every layer of the ratio before anything is written."""
        copies = []
        for p in range(lo // PAGE_ROWS, -(-hi // PAGE_ROWS)):
            page = int(self.host[slot, p])
            if page >= 0 and self.holders[page] == 1:
                continue
            new = self.free.pop()  # never empty: every slot's table fits in the pool (module docstring)
            self.holders[new] = 1
            if page >= 0:
                self.holders[page] -= 1
                copies.append((page, new))
            self.host[slot, p] = new
            self.table[slot, p] = new
        return copies

    def share(self, src: int, dst: int, n_rows: int) -> None:
        """The empty slot `dst` holds the pages of `src`'s first `n_rows` rows too."""
        n = -(-n_rows // PAGE_ROWS)
        pages = self.pages_of(src, n_rows)
        self.host[dst, :n] = pages
        self.holders[pages] += 1
        self.table[dst, :n] = self.table[src, :n]

    def release(self, slot: int) -> None:
        """The slot gives up its pages; those it held alone are free again."""
        pages = self.host[slot][self.host[slot] >= 0]
        self.holders[pages] -= 1
        self.free.extend(int(p) for p in pages[self.holders[pages] == 0])
        self.host[slot] = -1

    def share_of(self, slot: int) -> float:
        """The slot's pages, each counted as 1 / its holders: summed over the slots, the pages in use."""
        pages = self.host[slot][self.host[slot] >= 0]
        return float((1.0 / self.holders[pages]).sum())

    @property
    def pages_in_use(self) -> int:
        return int((self.holders > 0).sum())
