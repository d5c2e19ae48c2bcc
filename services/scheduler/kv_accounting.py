"""Where the KV pool's slots go, in the categories of the paper's Figure 2.

`kv_usage(scheduler)` splits every slot of the pool, at one instant, into exactly one of:

- token states: slots holding the KV of a live sequence's computed tokens;
- reserved: slots allocated to a sequence that it will fill later, up to its final
  length (prompt + max_tokens capped at max_model_len: exact with ignore_eos, an
  upper bound otherwise);
- internal fragmentation: slots the policy reserved beyond that final length, which
  the request never uses (reserve-max's 2048 less the real length, reserve-pow2's
  output rounded up to a power of two; none for reserve-oracle), and for the paged
  policy the unused tail of a sequence's final block;
- external fragmentation (contiguous reservations only; any free paged block serves
  any request): the allocator's own waste, slots of a chunk past the policy's
  reservation (the buddy allocator's rounding to a power of two, the rounding to whole
  blocks), plus free slots in holes too small for the chunk of the request at the
  head of the waiting queue, the one FCFS admits next;
- free: every other free slot (all of them when nothing waits), including cached
  blocks no sequence holds.

Allocator rounding is external, not internal, as in the paper: its section 3 calls
internal fragmentation "over-provisioning for potential maximum sequence lengths",
only known once a request has finished, and external fragmentation what comes "from
the memory allocator like the buddy allocator" and "is known before serving a
request"; its Orca (Oracle), placed by a buddy allocator, shows 0% internal.

Paged blocks shared by several sequences are counted once. The shares are of the
memory in use, the pool less `free`: the four categories sum to 100% like each bar of
Figure 2. That figure's vLLM bar (96.3% token states) cannot include idle memory, and
its Orca (Max) bar's 8.9% external fragmentation is the pool's tail no 2048-slot
chunk fits (15.7K - 7 x 2048 slots, 8.7% of the pool), free yet unusable because a
request waits. `free_share` is of the whole pool. Callers time-average the slot
counts and take shares of the averages.
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
        if not req.block_table:  # a fork that found no room holds nothing yet
            continue
        final, reservation = _final_len(req, max_len), alloc.reservation_tokens(req)
        reach = min(final, reservation)
        # its own reservation, then those held for its forks (which start from nothing)
        for computed in [req.num_computed_tokens] + [0] * len(alloc.fork_runs(req)):
            token_states += computed
            reserved += reach - computed
            internal += reservation - reach
    held = alloc.num_used_blocks * bs
    rounding = held - token_states - reserved - internal
    holes = [n for _, n in alloc.gaps()]
    need = alloc.chunk_blocks(scheduler.waiting[0]) if scheduler.waiting else 0
    unusable = sum(n for n in holes if n < need) * bs
    return KVUsage(
        token_states=token_states,
        reserved=reserved,
        internal_frag=internal,
        external_frag=rounding + unusable,
        free=sum(holes) * bs - unusable,
    )
