"""The scheduler's host block pool: which host blocks hold the KV of swapped-out sequences.

Bookkeeping only (the swap space of `--swap-space`): the executor owns the host tensors
(`services/executor/host_kv_cache.py`) and does the copies the
scheduler lists in a step (`swap_out` device -> host, `swap_in` host -> device).
"""

from __future__ import annotations

from collections import deque


class HostBlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_swap_out(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= len(self._free)

    def swap_out(self, device_blocks: list[int]) -> list[tuple[int, int]]:
        """Host blocks for these device blocks, as (device, host) copies to perform."""
        if not self.can_swap_out(len(device_blocks)):
            raise RuntimeError("swap_out without room: call can_swap_out first")
        return [(block, self._free.popleft()) for block in device_blocks]

    def free(self, host_blocks: list[int]) -> None:
        self._free.extend(host_blocks)
        host_blocks.clear()

    def check_invariants(self, swapped: list[list[int]]) -> None:
        held = [b for blocks in swapped for b in blocks]
        assert len(held) == len(set(held)), "a host block holds two sequences"
        assert not set(held) & set(self._free), "a host block is both free and held"
        assert len(held) + len(self._free) == self.num_blocks
