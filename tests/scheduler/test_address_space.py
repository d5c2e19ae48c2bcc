"""The address spaces contiguous reservations are placed in: the buddy allocator and
first fit, against a model of which units are taken, under random takes and releases
(hypothesis): no two chunks overlap, every unit is in one chunk or one hole, holes
coalesce, and a request is refused only when no hole could hold it."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.address_space import BuddySpace, FirstFitSpace, make_space

ops = st.lists(
    st.one_of(st.tuples(st.just("take"), st.integers(1, 70)), st.tuples(st.just("release"), st.integers(0, 99))),
    min_size=1,
    max_size=60,
)


def taken_units(space, chunks: dict[int, int]) -> list[bool]:
    """Which units are taken, rebuilt from the chunks handed out (start -> units)."""
    taken = [False] * space.size
    for start, n in chunks.items():
        for u in range(start, start + n):
            assert not taken[u], f"unit {u} is in two chunks"
            taken[u] = True
    return taken


def lowest_run(taken: list[bool], n: int) -> int | None:
    run = 0
    for i, t in enumerate(taken):
        run = 0 if t else run + 1
        if run == n:
            return i - n + 1
    return None


def buddy_blocks(space: BuddySpace, taken: list[bool], size: int) -> list[int]:
    """Starts of free aligned blocks of `size` units wholly inside one of the space's top blocks."""
    out, top_start = [], 0
    for order in range(space.max_order, -1, -1):
        if space.size >> order & 1:
            top = 1 << order
            if size <= top:
                out += [s for s in range(top_start, top_start + top, size) if not any(taken[s:s + size])]
            top_start += top
    return out


def check_accounting(space, chunks: dict[int, int]) -> None:
    space.check_invariants()
    taken = taken_units(space, chunks)
    assert dict(space.chunks()) == chunks
    assert space.used == sum(taken) == sum(chunks.values())
    holes = space.holes()
    assert sum(n for _, n in holes) == space.size - space.used  # every unit accounted
    for s, n in holes:
        assert not any(taken[s:s + n]), f"hole at {s} holds a chunk"


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 200), ops=ops)
def test_first_fit_takes_the_lowest_run_and_coalesces(size, ops):
    space = FirstFitSpace(size)
    chunks: dict[int, int] = {}
    for op, arg in ops:
        if op == "take":
            expected = lowest_run(taken_units(space, chunks), arg)
            start = space.take(arg)
            assert start == expected  # refused only when no run of arg free units exists
            if start is not None:
                chunks[start] = arg
        elif chunks:
            start = sorted(chunks)[arg % len(chunks)]
            space.release(start)
            del chunks[start]
        check_accounting(space, chunks)
        holes = space.holes()
        # coalesced: holes never touch, so each is a maximal free run
        assert all(s + n < t for (s, n), (t, _) in zip(holes, holes[1:], strict=False))
    for start in list(chunks):
        space.release(start)
        del chunks[start]
    assert space.holes() == [(0, size)]


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 200), ops=ops)
def test_buddy_chunks_are_aligned_powers_of_two_and_free_buddies_merge(size, ops):
    space = BuddySpace(size)
    chunks: dict[int, int] = {}
    for op, arg in ops:
        if op == "take":
            chunk = space.chunk_for(arg)
            assert chunk >= arg and chunk & (chunk - 1) == 0 and chunk < 2 * arg
            possible = buddy_blocks(space, taken_units(space, chunks), chunk)
            start = space.take(arg)
            # refused only when no aligned free block of that size is left
            assert (start is None) == (not possible)
            if start is not None:
                assert start % chunk == 0 and start in possible
                chunks[start] = chunk
        elif chunks:
            start = sorted(chunks)[arg % len(chunks)]
            space.release(start)
            del chunks[start]
        check_accounting(space, chunks)
        # coalesced: no free block's buddy is free too (check_invariants asserts it as well)
        free = set(space.holes())
        assert not any((s ^ n, n) in free for s, n in free if n < space.largest_chunk)
    for start in list(chunks):
        space.release(start)
        del chunks[start]
    # back to the top blocks, largest first
    tops, pos = [], 0
    for order in range(size.bit_length() - 1, -1, -1):
        if size >> order & 1:
            tops.append((pos, 1 << order))
            pos += 1 << order
    assert space.holes() == tops


def test_buddy_splits_the_smallest_block_and_leaves_unmergeable_holes():
    space = BuddySpace(16)
    a, b, c, d = (space.take(4) for _ in range(4))
    assert (a, b, c, d) == (0, 4, 8, 12)
    space.release(b)
    space.release(c)
    assert space.holes() == [(4, 4), (8, 4)]  # 8 free units in a row, not buddies
    assert space.take(8) is None and space.find(5) is None
    assert space.take(3) == 4  # a chunk of 4 in the lowest free block
    space.release(a)
    space.release(4)
    assert space.holes() == [(0, 8), (8, 4)]
    assert space.take(8) == 0


def test_make_space_knows_both_placements():
    assert isinstance(make_space("buddy", 10), BuddySpace)
    assert isinstance(make_space("first-fit", 10), FirstFitSpace)
    assert BuddySpace(15696).largest_chunk == 8192 and BuddySpace(15696).max_order == 13
    with pytest.raises(ValueError):
        make_space("best-fit", 10)
