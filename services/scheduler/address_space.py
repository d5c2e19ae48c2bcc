"""Where contiguous KV reservations go: one fixed address space of `size` units, two placers.

The reservation baselines (`reservation.ReservingAllocator`) give each request one
contiguous chunk. A placer decides which addresses the chunk takes; the holes left
between chunks as requests come and go are the baselines' external fragmentation.

- `BuddySpace` (the default, `"buddy"`): the binary buddy allocator. The paper
  (Kwon et al., SOSP 2023, section 6.1) says of its Orca baselines: "We assume Orca
  uses the buddy allocation algorithm to determine the memory address to store KV
  cache", and section 6.5 that "due to the buddy allocation algorithm" a 1024-token
  prompt gets 1024 slots for its output whatever the predicted length. A chunk of n
  units is a free block of next_pow2(n) units aligned to its size; the smallest free
  block that fits is split in halves down to that size, and a freed block merges with
  its buddy while the buddy is free. A space that is not a power of two is cut into
  aligned power-of-two top blocks, largest first (15696 = 8192 + 4096 + 2048 + 1024 +
  256 + 64 + 16), which never merge with each other.
- `FirstFitSpace` (`"first-fit"`): chunks of exactly n units at the lowest address
  where n free units start; freed chunks coalesce with free neighbours.

Both hand out the lowest-addressed candidate, so runs are reproducible.
"""

from __future__ import annotations

import bisect

PLACEMENTS = ("buddy", "first-fit")


class FirstFitSpace:
    """Exact-size chunks, lowest address first; holes are maximal free runs."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError("an address space needs at least one unit")
        self.size = size
        self.used = 0
        self._starts: list[int] = []  # sorted starts of the chunks
        self._ends: dict[int, int] = {}  # chunk start -> end (exclusive)

    @property
    def largest_chunk(self) -> int:
        return self.size

    def chunk_for(self, n: int) -> int:
        """Units a chunk for n units takes."""
        return n

    def find(self, n: int) -> int | None:
        """Where a chunk for n units would start now, or None."""
        prev = 0
        for s in self._starts:
            if s - prev >= n:
                return prev
            prev = self._ends[s]
        return prev if self.size - prev >= n else None

    def take(self, n: int) -> int | None:
        """Take a chunk for n units; its start, or None with nothing changed."""
        start = self.find(n)
        if start is not None:
            bisect.insort(self._starts, start)
            self._ends[start] = start + n
            self.used += n
        return start

    def release(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        self.used -= self._ends.pop(start) - start

    def chunks(self) -> list[tuple[int, int]]:
        """Taken chunks as (start, units), in address order."""
        return [(s, self._ends[s] - s) for s in self._starts]

    def holes(self) -> list[tuple[int, int]]:
        """Free runs as (start, units), in address order, each as large as it can be."""
        out, prev = [], 0
        for s in self._starts:
            if s > prev:
                out.append((prev, s - prev))
            prev = self._ends[s]
        if prev < self.size:
            out.append((prev, self.size - prev))
        return out

    def check_invariants(self) -> None:
        _check_tiling(self.size, self.chunks(), self.holes())
        assert sorted(self._ends) == self._starts
        holes = self.holes()
        for (s, n), (t, _) in zip(holes, holes[1:], strict=False):
            assert s + n < t, f"holes at {s} and {t} touch: not coalesced"


def _order(n: int) -> int:
    """The buddy order of a chunk for n units: log2 of next_pow2(n)."""
    return max(0, n - 1).bit_length()


class BuddySpace:
    """Power-of-two chunks aligned to their size; holes are free buddy blocks."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError("an address space needs at least one unit")
        self.size = size
        self.used = 0
        self.max_order = size.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]  # order -> free block starts
        self._taken: dict[int, int] = {}  # chunk start -> order
        start = 0
        for order in range(self.max_order, -1, -1):  # top blocks, largest first: each is aligned
            if size >> order & 1:
                self._free[order].add(start)
                start += 1 << order

    @property
    def largest_chunk(self) -> int:
        return 1 << self.max_order

    def chunk_for(self, n: int) -> int:
        return 1 << _order(n)

    def _smallest_free(self, order: int) -> tuple[int, int] | None:
        """(order, start) of the lowest free block of the smallest order >= order that has one."""
        for k in range(order, self.max_order + 1):
            if self._free[k]:
                return k, min(self._free[k])
        return None

    def find(self, n: int) -> int | None:
        # the split keeps the lower half each time, so the chunk starts where its block does
        found = self._smallest_free(_order(n)) if n <= self.largest_chunk else None
        return None if found is None else found[1]

    def take(self, n: int) -> int | None:
        order = _order(n)
        found = self._smallest_free(order) if n <= self.largest_chunk else None
        if found is None:
            return None
        k, start = found
        self._free[k].remove(start)
        while k > order:
            k -= 1
            self._free[k].add(start + (1 << k))
        self._taken[start] = order
        self.used += 1 << order
        return start

    def release(self, start: int) -> None:
        order = self._taken.pop(start)
        self.used -= 1 << order
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    def chunks(self) -> list[tuple[int, int]]:
        return sorted((s, 1 << k) for s, k in self._taken.items())

    def holes(self) -> list[tuple[int, int]]:
        """Free blocks as (start, units), in address order. Neighbouring blocks that are
        not buddies stay apart: together they cannot hold a chunk either fits not."""
        return sorted((s, 1 << k) for k, starts in enumerate(self._free) for s in starts)

    def check_invariants(self) -> None:
        _check_tiling(self.size, self.chunks(), self.holes())
        for s, n in self.chunks() + self.holes():
            assert s % n == 0, f"block at {s} of {n} units is not aligned to its size"
        for k, starts in enumerate(self._free[: self.max_order]):
            for s in starts:
                assert s ^ (1 << k) not in starts, f"free buddies at {s} (order {k}) not merged"


def _check_tiling(size: int, chunks: list[tuple[int, int]], holes: list[tuple[int, int]]) -> None:
    """Chunks and holes cover [0, size) exactly once between them."""
    pos = 0
    for s, n in sorted(chunks + holes):
        assert n > 0, f"empty block at {s}"
        assert s == pos, f"{'overlap' if s < pos else 'unaccounted units'} at {min(s, pos)}"
        pos = s + n
    assert pos == size, f"blocks end at {pos}, not at the space's end {size}"


def make_space(placement: str, size: int) -> BuddySpace | FirstFitSpace:
    if placement == "buddy":
        return BuddySpace(size)
    if placement == "first-fit":
        return FirstFitSpace(size)
    raise ValueError(f"unknown placement {placement!r}; one of {PLACEMENTS}")
