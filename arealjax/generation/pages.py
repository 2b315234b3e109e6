"""Host bookkeeping of the KV page pool: which pages are free, who holds each page, and the index arrays a
decode call reads (models/paged.py).

Pages are handed out lowest-numbered first and counted by reference, so the n samples of one prompt can hold its
full pages together (a page is free again when its last holder releases it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from arealjax.models import DecodeIndex

MIN_PAIRS = 16  # smallest padded length of the ragged (row, page) list


class PagePool:
    """Free pages and reference counts of `num_pages` pages of `page_size` tokens."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages))  # a heap: lowest page first
        self._refs = np.zeros(num_pages, np.int32)
        self.peak = 0  # most pages held at once

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` tokens."""
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} KV pages requested, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._refs[pages] = 1
        self.peak = max(self.peak, self.used)
        return pages

    def share(self, pages: Sequence[int]) -> list[int]:
        """One more holder of `pages` (already held)."""
        for p in pages:
            assert self._refs[p] > 0, f"page {p} is not held"
            self._refs[p] += 1
        return list(pages)

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released twice"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)


def decode_index(pages: Sequence[Sequence[int]], last: Sequence[int], rows: int, max_pages: int, num_pages: int,
                 page_size: int) -> DecodeIndex:
    """Index arrays for a decode call over len(pages) sequences padded to `rows`: sequence i holds pages[i] and
    reads/writes positions up to last[i] during the call (a row with no pages is unused and reads nothing). The
    ragged pair list is padded to a power of two."""
    table = np.full((rows, max_pages), num_pages, np.int32)
    counts = np.array([p // page_size + 1 if ps else 0 for p, ps in zip(last, pages)], np.int64)  # none: unused
    for i, ps in enumerate(pages):
        assert len(ps) >= counts[i], f"sequence {i} reads position {last[i]} but holds {len(ps)} pages"
        table[i, :len(ps)] = ps
    total = int(counts.sum())
    n = max(MIN_PAIRS, 1 << max(0, total - 1).bit_length())
    pair_row = np.full(n, rows, np.int32)
    pair_page = np.zeros(n, np.int32)
    pair_start = np.zeros(n, np.int32)
    pair_row[:total] = np.repeat(np.arange(len(pages), dtype=np.int32), counts)
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)  # page number within its sequence
    pair_page[:total] = table[pair_row[:total], within]
    pair_start[:total] = within * page_size
    return DecodeIndex(table, pair_row, pair_page, pair_start)
