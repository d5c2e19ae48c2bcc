"""Contiguous-reservation KV allocators: the paper's baselines as `--kv-policy` values.

Orca and FasterTransformer give each request one contiguous chunk of KV memory for
the longest it may grow, reserved when it is admitted:

- `reserve-max`: max_model_len slots (Orca (Max), FasterTransformer);
- `reserve-pow2`: prompt + the next power of two of its real output length;
- `reserve-oracle`: prompt + exactly its real output length.

The "real output length" is `params.max_tokens`: exact when the request runs with
ignore_eos, an upper bound otherwise. A reservation is capped at max_model_len (no
sequence grows past it) and at the largest chunk the address space can place.

The pool is one fixed address space of blocks (`address_space`). By default a
request's chunk is placed by the binary buddy allocator, as the paper assumes for its
Orca baselines: the chunk is the reservation rounded up to a power of two of blocks,
and freed chunks leave holes a larger request cannot use until their buddies are free
too (external fragmentation). `placement="first-fit"` places exact-size chunks at the
lowest address that fits instead. The block table lists the reservation's blocks, the
first of its chunk; the chunk's rest (power-of-two rounding) and the rounding of the
reservation to whole blocks are the allocator's waste, which accounting counts as
external fragmentation (known before the request runs), not internal.

The interface is `BlockManager`'s, so the same `Scheduler` runs either. Growing
within the reservation never needs a block, so `can_append` holds for any request
that passed `Scheduler.check_fits` and these policies never preempt. Nothing is
shared: there is no prefix cache, and a forked sequence (parallel sample, beam)
gets a reservation of its own and recomputes its tokens into it. A request with
parallel samples reserves a run for each sample that fits when it is admitted
(only its own run must fit, so it never waits on room it may never get); a fork
that finds no run held for it takes one then or at its first step, or
the scheduler preempts it back to the queue until one fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.scheduler.address_space import make_space
from services.scheduler.block_manager import BlockManager

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence

RESERVE_POLICIES = ("reserve-max", "reserve-pow2", "reserve-oracle")
POLICIES = ("paged", *RESERVE_POLICIES)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class ReservingAllocator:
    """Contiguous reservations over num_blocks blocks of block_size slots, placed by
    a buddy allocator (default) or first fit."""

    def __init__(self, policy: str, num_blocks: int, block_size: int, max_model_len: int,
                 placement: str = "buddy"):
        if policy not in RESERVE_POLICIES:
            raise ValueError(f"unknown reservation policy {policy!r}; one of {RESERVE_POLICIES}")
        if num_blocks < 1 or block_size < 1 or max_model_len < 1:
            raise ValueError("num_blocks, block_size and max_model_len must be positive")
        self.policy = policy
        self.placement = placement
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.space = make_space(placement, num_blocks)
        self._for_forks: dict[int, list[int]] = {}  # a parent's chunk start -> chunks its forks will take
        # BlockManager's counters, so `Scheduler.stats()` works with either allocator.
        self.num_cached_blocks = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- counts ---------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self.space.used

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.space.used

    @property
    def max_sequence_blocks(self) -> int:
        """The most blocks one sequence can ever hold: the largest chunk there is."""
        return self.space.largest_chunk

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reservation_tokens(self, seq: Sequence) -> int:
        """Slots the policy reserves for seq, before the allocator rounds them."""
        prompt, out = seq.num_prompt_tokens, seq.params.max_tokens
        if self.policy == "reserve-max":
            want = self.max_model_len
        elif self.policy == "reserve-pow2":
            want = prompt + next_pow2(out)
        else:
            want = prompt + out
        return min(want, self.max_model_len, self.space.largest_chunk * self.block_size)

    def reservation_blocks(self, seq: Sequence) -> int:
        """Blocks seq's block table lists: its reservation in whole blocks."""
        return self.blocks_for(self.reservation_tokens(seq))

    def chunk_blocks(self, seq: Sequence) -> int:
        """Blocks the allocator takes for seq's reservation."""
        return self.space.chunk_for(self.reservation_blocks(seq))

    def runs(self) -> list[tuple[int, int]]:
        """Taken chunks as (start block, number of blocks), in address order."""
        return self.space.chunks()

    def gaps(self) -> list[tuple[int, int]]:
        """Holes as (start block, number of blocks), in address order: maximal free runs
        under first fit, free buddy blocks under the buddy allocator."""
        return self.space.holes()

    def fork_runs(self, seq: Sequence) -> list[int]:
        """Lengths in blocks of the reservations held for seq's future forks."""
        if not seq.block_table:
            return []
        return [self.reservation_blocks(seq)] * len(self._for_forks.get(seq.block_table[0], []))

    def _take(self, seq: Sequence) -> int | None:
        """Take a chunk for seq's reservation; its start, or None when no hole fits."""
        return self.space.take(self.reservation_blocks(seq))

    def _fits(self, seq: Sequence) -> bool:
        return self.space.find(self.reservation_blocks(seq)) is not None

    # --- a new sequence -------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Nothing is cached."""
        return []

    def _can_reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        return (not seq.block_table and self.blocks_for(num_new_tokens) <= self.reservation_blocks(seq)
                and self._fits(seq))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int]) -> list[int] | None:
        """Reserve seq's run, and one for each pending fork that fits now; sets
        num_computed_tokens to 0. Returns seq's run, or None, with nothing changed, when
        it does not fit (computed_blocks is always empty: nothing is cached)."""
        if computed_blocks or not self._can_reserve(seq, num_new_tokens):
            return None
        self._take_runs(seq)
        seq.num_computed_tokens = 0
        return list(seq.block_table)

    def _take_runs(self, seq: Sequence) -> None:
        n = self.reservation_blocks(seq)
        start = self._take(seq)
        assert start is not None
        seq.block_table.extend(range(start, start + n))
        held = []
        for _ in range(getattr(seq, "pending_forks", 0)):
            fork_start = self._take(seq)
            if fork_start is None:
                break
            held.append(fork_start)
        if held:
            self._for_forks[start] = held

    def can_restore(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for a swapped-out sequence to come back with num_new_tokens more."""
        return self._can_reserve(seq, seq.num_computed_tokens + num_new_tokens)

    def restore(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """A fresh run for a swapped-out sequence; returns the blocks its swapped KV goes into."""
        if not self.can_restore(seq, num_new_tokens):
            raise RuntimeError("restore without room: call can_restore first")
        self._take_runs(seq)
        return seq.block_table[: self.blocks_for(seq.num_computed_tokens)]

    def reset_cache(self) -> None:
        """Nothing is cached."""

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """Nothing is cached."""

    # --- a running sequence grows ---------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        end = seq.num_computed_tokens + num_new_tokens
        if not seq.block_table:  # forked without room: it reserves now or waits
            return end <= self.reservation_blocks(seq) * self.block_size and self._fits(seq)
        return end <= len(seq.block_table) * self.block_size

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError("append past the reservation: call can_append first")
        if not seq.block_table:
            start = self._take(seq)
            seq.block_table.extend(range(start, start + self.reservation_blocks(seq)))
        return []

    # --- forks and release ----------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child takes a chunk held for it, or one placed now, and computes from 0.

        With no room (or a parent holding nothing) the child gets no run yet: it
        reserves one at its first append if a gap fits by then (see `can_append`),
        else the scheduler preempts it back to the queue.
        """
        if child.block_table:
            raise RuntimeError("fork into a sequence that already holds blocks")
        child.num_computed_tokens = 0
        if not parent.block_table:
            return
        held = self._for_forks.get(parent.block_table[0])
        if held:
            start = held.pop()
            if not held:
                del self._for_forks[parent.block_table[0]]
        else:
            start = self._take(parent)
            if start is None:
                return
        child.block_table.extend(range(start, start + self.reservation_blocks(parent)))

    def free(self, seq: Sequence) -> None:
        if not seq.block_table:
            return
        start = seq.block_table[0]
        for fork_start in self._for_forks.pop(start, []):
            self.space.release(fork_start)
        self.space.release(start)
        seq.block_table.clear()

    def slot_mapping(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        base = seq.block_table[0] * self.block_size
        return list(range(base + start, base + start + num_tokens))

    # --- invariants -----------------------------------------------------------------

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless the chunks and holes tile the pool (disjoint,
        coalesced), each table is the start of one chunk, and every chunk belongs to
        one table or is held for a fork."""
        self.space.check_invariants()
        tables = list(tables)
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
        chunks = dict(self.runs())
        owners = [t[0] for t in tables if t]
        held = [s for starts in self._for_forks.values() for s in starts]
        assert sorted(owners + held) == sorted(chunks), "chunks and block tables disagree"
        assert set(self._for_forks) <= set(owners), "fork chunks held for a sequence that left"
        for t in tables:
            if t:
                assert t == list(range(t[0], t[0] + len(t))), f"table at {t[0]} is not contiguous"
                assert len(t) <= chunks[t[0]], f"table at {t[0]} runs past its chunk"


def make_allocator(
    policy: str, num_blocks: int, block_size: int, max_model_len: int, enable_prefix_caching: bool = True,
    placement: str = "buddy",
) -> BlockManager | ReservingAllocator:
    """The KV allocator for `--kv-policy`: the paged block manager or a reservation baseline
    (placed by `placement`, see `address_space`)."""
    if policy == "paged":
        return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    if policy in RESERVE_POLICIES:
        return ReservingAllocator(policy, num_blocks, block_size, max_model_len, placement)
    raise ValueError(f"unknown KV policy {policy!r}; one of {POLICIES}")
