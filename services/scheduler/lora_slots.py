"""Which LoRA adapter each of the executor's `max_loras` slots holds: the scheduler owns the
assignment, so a step never runs more distinct adapters than there are slots, and tells the
executor which slot holds which adapter with every step (`ExecuteStep.lora_slots`).

An adapter is keyed by its files' digest. A running sequence pins its adapter's slot (the
scheduler passes the pinned digests of each step); a waiting request whose adapter is not
in a slot takes an empty one, else the least recently used unpinned one, else it waits
(the scheduler skips it and admits the requests behind it). Pure bookkeeping.
"""

from __future__ import annotations

from shared.messages import LoraAdapter


class LoraSlotTable:
    def __init__(self, max_loras: int):
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0

    def slot_of(self, adapter: LoraAdapter) -> int | None:
        return next((i for i, held in enumerate(self.slots) if held is not None and held.digest == adapter.digest),
                    None)

    def assign(self, adapter: LoraAdapter, pinned: set[str]) -> int | None:
        """adapter's slot, given one if it has none (an empty slot, else the least recently used
        one whose adapter is not pinned); None when every slot is pinned by another adapter."""
        slot = self.slot_of(adapter)
        if slot is None:
            free = [i for i, held in enumerate(self.slots) if held is None or held.digest not in pinned]
            if not free:
                return None
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._last_used[i]))
            self.slots[slot] = adapter
        self._clock += 1
        self._last_used[slot] = self._clock
        return slot

    def step_slots(self, adapters: list[LoraAdapter | None]) -> tuple[list[int], list[tuple[int, LoraAdapter]]]:
        """The slot of each row's adapter (-1 for none) and the (slot, adapter) pairs the step names.
        A row's adapter always has a slot: it was pinned from its admission on."""
        rows = [-1 if a is None else self.slot_of(a) for a in adapters]
        if None in rows:
            raise RuntimeError("a running sequence's LoRA adapter lost its slot")
        return rows, sorted({(s, self.slots[s]) for s in rows if s >= 0}, key=lambda pair: pair[0])

    def check_invariants(self, running: list[LoraAdapter | None]) -> None:
        held = [a.digest for a in self.slots if a is not None]
        assert len(held) == len(set(held)), "an adapter in two slots"
        needed = {a.digest for a in running if a is not None}
        assert needed <= set(held), "a running sequence's adapter has no slot"
