"""Block manager: allocation on demand, copy-on-write, and invariants under random use."""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager


@dataclass(eq=False)
class Seq:
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_tokens: int = 0


def grow(bm: BlockManager, seq: Seq, n: int) -> list[tuple[int, int]]:
    copies = bm.append_slots(seq, n) if seq.block_table else (bm.allocate(seq, n) or [])
    seq.num_computed_tokens += n
    return copies


def test_allocates_on_demand_at_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq()
    assert bm.can_allocate(seq, 5)
    grow(bm, seq, 5)
    assert len(seq.block_table) == 2
    for _ in range(3):  # tokens 6..8 fill block 2
        grow(bm, seq, 1)
    assert len(seq.block_table) == 2
    grow(bm, seq, 1)
    assert len(seq.block_table) == 3
    assert bm.slot_mapping(seq, 8, 1) == [seq.block_table[2] * 4]
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_can_refuses_what_do_would_not_fit():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = Seq()
    assert not bm.can_allocate(a, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(a, 9)
    grow(bm, a, 8)
    assert not bm.can_append(a, 1)
    with pytest.raises(RuntimeError):
        bm.append_slots(a, 1)


def test_fork_shares_blocks_and_first_write_copies_the_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Seq()
    grow(bm, parent, 6)  # one full block, one partial
    child = Seq()
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.num_used_blocks == 2
    copies = grow(bm, child, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent.block_table[1] and dst == child.block_table[1] and src != dst
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert grow(bm, parent, 1) == []  # the parent now owns its partial block alone
    bm.check_invariants([parent.block_table, child.block_table])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 50), st.integers(1, 20)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([1, 4, 16]), st.integers(4, 40))
def test_invariants_hold_under_random_operations(operations, block_size, num_blocks):
    bm = BlockManager(num_blocks, block_size)
    seqs: list[Seq] = []
    for op, pick, n in operations:
        target = seqs[pick % len(seqs)] if seqs else None
        if op == "new" and bm.can_allocate(s := Seq(), n):
            bm.allocate(s, n)
            s.num_computed_tokens = n
            seqs.append(s)
        elif op == "grow" and target and bm.can_append(target, n):
            start = target.num_computed_tokens
            bm.append_slots(target, n)
            for slot in bm.slot_mapping(target, start, n):
                block = slot // block_size
                assert bm.ref_counts[block] == 1, "a shared block is about to be written"
            target.num_computed_tokens += n
        elif op == "fork" and target:
            child = Seq()
            bm.fork(target, child)
            seqs.append(child)
        elif op == "free" and target:
            bm.free(target)
            seqs.remove(target)
        bm.check_invariants([s.block_table for s in seqs])
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == num_blocks
