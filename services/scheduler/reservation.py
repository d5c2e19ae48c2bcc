"""Contiguous-reservation KV allocators: the paper's baselines as `--kv-policy` values.

Orca and FasterTransformer give each request one contiguous chunk of KV memory for
the longest it may grow, reserved when it is admitted:

- `reserve-max`: max_model_len slots (Orca (Max), FasterTransformer);
- `reserve-pow2`: prompt + the next power of two of its real output length;
- `reserve-oracle`: prompt + exactly its real output length.

The "real output length" is `params.max_tokens`: exact when the request runs with
ignore_eos, an upper bound otherwise. A reservation is capped at max_model_len (no
sequence grows past it) and at the pool.

The pool is one contiguous range of slots, handed out first-fit, so freed
reservations leave gaps that a larger request cannot use (external fragmentation)
as in those systems. To give the executor an ordinary block table, a reservation is
a run of consecutive blocks: its start and length are rounded to block boundaries,
and the block table lists the run. The rounding is the only difference from a
slot-granular allocator: each reservation wastes up to block_size - 1 slots past
its end, which accounting counts as internal fragmentation (so reserve-oracle shows
some unless block_size is 1), and gaps come in whole blocks.

The interface is `BlockManager`'s, so the same `Scheduler` runs either. Growing
within the reservation never needs a block, so `can_append` holds for any request
that passed `Scheduler.check_fits` and these policies never preempt. Nothing is
shared: there is no prefix cache, and a forked sequence (parallel sample, beam)
gets a reservation of its own and recomputes its tokens into it. A request with
parallel samples reserves a run for each sample that fits when it is admitted
(only its own run must fit, so it never waits on room it may never get); a fork
that finds no run held for it takes one first-fit then or at its first step, or
the scheduler preempts it back to the queue until one fits.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.scheduler.block_manager import BlockManager

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence

RESERVE_POLICIES = ("reserve-max", "reserve-pow2", "reserve-oracle")
POLICIES = ("paged", *RESERVE_POLICIES)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class ReservingAllocator:
    """First-fit contiguous reservations over num_blocks blocks of block_size slots."""

    def __init__(self, policy: str, num_blocks: int, block_size: int, max_model_len: int):
        if policy not in RESERVE_POLICIES:
            raise ValueError(f"unknown reservation policy {policy!r}; one of {RESERVE_POLICIES}")
        if num_blocks < 1 or block_size < 1 or max_model_len < 1:
            raise ValueError("num_blocks, block_size and max_model_len must be positive")
        self.policy = policy
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._starts: list[int] = []  # sorted starts of the reserved runs
        self._ends: dict[int, int] = {}  # run start -> end (exclusive)
        self._for_forks: dict[int, list[int]] = {}  # a parent's run start -> runs its forks will take
        self._used = 0
        # BlockManager's counters, so `Scheduler.stats()` works with either allocator.
        self.num_cached_blocks = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- counts ---------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self._used

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reservation_tokens(self, seq: Sequence) -> int:
        """Slots the policy reserves for seq, before rounding to blocks."""
        prompt, out = seq.num_prompt_tokens, seq.params.max_tokens
        if self.policy == "reserve-max":
            want = self.max_model_len
        elif self.policy == "reserve-pow2":
            want = prompt + next_pow2(out)
        else:
            want = prompt + out
        return min(want, self.max_model_len, self.num_blocks * self.block_size)

    def reservation_blocks(self, seq: Sequence) -> int:
        return self.blocks_for(self.reservation_tokens(seq))

    def runs(self) -> list[tuple[int, int]]:
        """Reserved runs as (start block, number of blocks), in address order."""
        return [(s, self._ends[s] - s) for s in self._starts]

    def gaps(self) -> list[tuple[int, int]]:
        """Free runs as (start block, number of blocks), in address order."""
        out, prev = [], 0
        for s in self._starts:
            if s > prev:
                out.append((prev, s - prev))
            prev = self._ends[s]
        if prev < self.num_blocks:
            out.append((prev, self.num_blocks - prev))
        return out

    def fork_runs(self, seq: Sequence) -> list[int]:
        """Lengths in blocks of the runs held for seq's future forks."""
        if not seq.block_table:
            return []
        return [self._ends[s] - s for s in self._for_forks.get(seq.block_table[0], [])]

    # --- first fit ------------------------------------------------------------------

    def _first_fit(self, n: int) -> int | None:
        """Lowest block where n free blocks start, or None."""
        prev = 0
        for s in self._starts:
            if s - prev >= n:
                return prev
            prev = self._ends[s]
        return prev if self.num_blocks - prev >= n else None

    def _reserve(self, start: int, n: int) -> None:
        bisect.insort(self._starts, start)
        self._ends[start] = start + n
        self._used += n

    def _release(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        self._used -= self._ends.pop(start) - start

    # --- a new sequence -------------------------------------------------------------

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Nothing is cached."""
        return []

    def _can_reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        n = self.reservation_blocks(seq)
        return not seq.block_table and self.blocks_for(num_new_tokens) <= n and self._first_fit(n) is not None

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
        start = self._first_fit(n)
        assert start is not None
        self._reserve(start, n)
        seq.block_table.extend(range(start, start + n))
        held = []
        for _ in range(getattr(seq, "pending_forks", 0)):
            fork_start = self._first_fit(n)
            if fork_start is None:
                break
            self._reserve(fork_start, n)
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
            return end <= self.reservation_blocks(seq) * self.block_size and (
                self._first_fit(self.reservation_blocks(seq)) is not None
            )
        return end <= len(seq.block_table) * self.block_size

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError("append past the reservation: call can_append first")
        if not seq.block_table:
            n = self.reservation_blocks(seq)
            start = self._first_fit(n)
            self._reserve(start, n)
            seq.block_table.extend(range(start, start + n))
        return []

    # --- forks and release ----------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child takes a run held for it, or first-fit now, and computes from 0.

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
            start = self._first_fit(self.reservation_blocks(parent))
            if start is None:
                return
            self._reserve(start, self.reservation_blocks(parent))
        child.block_table.extend(range(start, self._ends[start]))

    def free(self, seq: Sequence) -> None:
        if not seq.block_table:
            return
        start = seq.block_table[0]
        for fork_start in self._for_forks.pop(start, []):
            self._release(fork_start)
        self._release(start)
        seq.block_table.clear()

    def slot_mapping(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        base = seq.block_table[0] * self.block_size
        return list(range(base + start, base + start + num_tokens))

    # --- invariants -----------------------------------------------------------------

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless runs are disjoint, each table is one whole run,
        and every run belongs to one table or is held for a fork."""
        tables = list(tables)
        prev = 0
        for s in self._starts:
            assert s >= prev, f"run at block {s} overlaps the one before"
            assert self._ends[s] > s, f"empty run at block {s}"
            prev = self._ends[s]
        assert prev <= self.num_blocks, "a run ends past the pool"
        assert sorted(self._ends) == self._starts
        assert self._used == sum(e - s for s, e in self._ends.items())
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
        owners = [t[0] for t in tables if t]
        held = [s for starts in self._for_forks.values() for s in starts]
        assert sorted(owners + held) == self._starts, "runs and block tables disagree"
        assert set(self._for_forks) <= set(owners), "fork runs held for a sequence that left"
        for t in tables:
            if t:
                assert t == list(range(t[0], self._ends[t[0]])), f"table at {t[0]} is not its whole run"


def make_allocator(
    policy: str, num_blocks: int, block_size: int, max_model_len: int, enable_prefix_caching: bool = True
) -> BlockManager | ReservingAllocator:
    """The KV allocator for `--kv-policy`: the paged block manager or a reservation baseline."""
    if policy == "paged":
        return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    if policy in RESERVE_POLICIES:
        return ReservingAllocator(policy, num_blocks, block_size, max_model_len)
    raise ValueError(f"unknown KV policy {policy!r}; one of {POLICIES}")
