"""Physical KV block pool: allocation on demand, reference counts, copy-on-write.

Pure bookkeeping over block ids; it knows nothing about models, tensors or sockets.
Each operation comes as a pair, a side-effect-free "can" and a "do" (`can_allocate`/
`allocate`, `can_append`/`append_slots`), plus `fork` and `free`. A sequence is
anything with a `block_table` list and a `num_computed_tokens` count; block i of the
table holds the KV of token positions [i * block_size, (i + 1) * block_size).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Protocol


class Sequence(Protocol):
    block_table: list[int]
    num_computed_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        end = seq.num_computed_tokens + num_new_tokens
        need = max(0, self.blocks_for(end) - len(seq.block_table))
        if self._shared_write_block(seq) is not None:
            need += 1
        return need

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the table of the block the next write lands in, if others share it."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def _take(self) -> int:
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)

    # --- a new sequence -------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return not seq.block_table and self.blocks_for(num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for the first num_new_tokens tokens of a sequence that holds none."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("allocate without room: call can_allocate first")
        seq.block_table.extend(self._take() for _ in range(self.blocks_for(num_new_tokens)))

    # --- a running sequence grows ---------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for num_new_tokens more tokens; returns (src, dst) block copies.

        A block shared with another sequence is never written: the first write into
        it gets a private copy (copy-on-write), which the executor must perform first.
        """
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError("append_slots without room: call can_append first")
        copies = []
        idx = self._shared_write_block(seq)
        if idx is not None:
            src = seq.block_table[idx]
            dst = self._take()
            self._release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        end = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_for(end):
            seq.block_table.append(self._take())
        return copies

    # --- sharing and release --------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (for parallel sampling, beams)."""
        if child.block_table:
            raise RuntimeError("fork into a sequence that already holds blocks")
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table.extend(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table.clear()

    def slot_mapping(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    # --- invariants -----------------------------------------------------------------

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless the pool is consistent with these block tables."""
        refs = Counter(b for table in tables for b in table)
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == refs.get(block, 0), f"ref count of block {block}"
            assert (block in free) == (self.ref_counts[block] == 0), f"block {block} free/used"
        assert len(free) + sum(1 for r in self.ref_counts if r > 0) == self.num_blocks
