"""Where the KV pool's slots go, in the categories of the paper's Figure 2.

`kv_usage(scheduler)` splits every slot of the pool into exactly one of:

- token states: slots holding the KV of computed tokens;
- reserved: allocated slots a running sequence will fill later (positions below its
  final length, prompt + max_tokens capped at max_model_len; exact with ignore_eos,
  an upper bound otherwise);
- internal fragmentation: allocated slots it will never fill (positions at or past
  its final length): a reservation's over-reservation and block rounding, and for
  the paged policy the unused tail of a sequence's final block;
- external fragmentation: free slots in gaps too small for the reservation of the
  request at the head of the waiting queue (first-fit reservations only; the paged
  pool has none: any free block serves any request);
- free: every other free slot, including cached blocks no sequence holds.

Paged blocks shared by several sequences are counted once. Shares of the memory in
use (the pool less `free`) match the paper's Figure 2, whose shares sum to 100%
of the memory under load; `free_share` is of the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.reservation import ReservingAllocator

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class KVUsage:
    """Slot counts by category (floats when time-averaged)."""

    token_states: float
    reserved: float
    internal_frag: float
    external_frag: float
    free: float

    @property
    def total(self) -> float:
        return self.token_states + self.reserved + self.internal_frag + self.external_frag + self.free

    @property
    def in_use(self) -> float:
        return self.total - self.free

    def _share(self, slots: float) -> float:
        return slots / self.in_use if self.in_use else 0.0

    @property
    def token_state_share(self) -> float:
        return self._share(self.token_states)

    @property
    def reserved_share(self) -> float:
        return self._share(self.reserved)

    @property
    def internal_frag_share(self) -> float:
        return self._share(self.internal_frag)

    @property
    def external_frag_share(self) -> float:
        return self._share(self.external_frag)

    @property
    def free_share(self) -> float:
        return self.free / self.total if self.total else 0.0


def kv_usage(scheduler: Scheduler) -> KVUsage:
    """The pool's slots by category, from the allocator and the running sequences."""
    if isinstance(scheduler.blocks, ReservingAllocator):
        return _reserved_usage(scheduler, scheduler.blocks)
    return _paged_usage(scheduler)


def _final_len(req, max_model_len: int) -> int:
    return min(req.num_prompt_tokens + req.params.max_tokens, max_model_len)


def _paged_usage(scheduler: Scheduler) -> KVUsage:
    bm = scheduler.blocks
    bs, max_len = bm.block_size, scheduler.config.max_model_len
    # Per physical block: slots filled and slots some holder will reach, the most
    # over its holders. Full leading blocks are set last: bs is their maximum.
    filled: dict[int, int] = {}
    reach: dict[int, int] = {}
    full: list[int] = []
    for req in scheduler.running:
        table, computed, final = req.block_table, req.num_computed_tokens, _final_len(req, max_len)
        n_full = min(computed // bs, len(table))
        full += table[:n_full]
        for i in range(n_full, len(table)):
            b, pos = table[i], i * bs
            f = min(max(computed - pos, 0), bs)
            r = min(max(final - pos, f), bs)
            if f > filled.get(b, -1):
                filled[b] = f
            if r > reach.get(b, -1):
                reach[b] = r
    whole = dict.fromkeys(full, bs)
    filled.update(whole)
    reach.update(whole)
    token_states, reached = sum(filled.values()), sum(reach.values())
    allocated = len(filled) * bs
    return KVUsage(
        token_states=token_states,
        reserved=reached - token_states,
        internal_frag=allocated - reached,
        external_frag=0,
        free=bm.num_blocks * bs - allocated,
    )


def _reserved_usage(scheduler: Scheduler, alloc: ReservingAllocator) -> KVUsage:
    bs, max_len = alloc.block_size, scheduler.config.max_model_len
    token_states = reserved = internal = 0
    for req in scheduler.running:
        final = _final_len(req, max_len)
        # its own run, then runs held for its forks (which start from nothing)
        for length, computed in [(len(req.block_table), req.num_computed_tokens)] + [
            (n, 0) for n in alloc.fork_runs(req)
        ]:
            slots = length * bs
            reach = min(final, slots)
            token_states += computed
            reserved += reach - computed
            internal += slots - reach
    gaps = [n for _, n in alloc.gaps()]
    need = alloc.reservation_blocks(scheduler.waiting[0]) if scheduler.waiting else 0
    external = sum(n for n in gaps if n < need) * bs
    return KVUsage(
        token_states=token_states,
        reserved=reserved,
        internal_frag=internal,
        external_frag=external,
        free=sum(gaps) * bs - external,
    )
