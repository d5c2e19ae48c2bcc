"""The waiting queue under `--scheduling-policy priority`: sequences by (priority, arrival).

A lower `priority` goes first, then the earlier `arrival_time`; among sequences equal in
both (the samples or beams of one request), `append` puts one behind the others and
`appendleft` ahead of them, as a deque would. It offers the deque operations the scheduler
uses (append, appendleft, extend, remove, [i], iteration in order, len, in), so under
fcfs the scheduler keeps its plain deque and nothing changes. Each insert is a bisect
into a sorted list (O(log n) comparisons and one memmove), each remove finds its entry by
bisect: nothing is sorted per step.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence


def rank(seq: Sequence) -> tuple[int, float]:
    """The order of the priority policy: lower priority value first, then the earlier arrival."""
    return seq.priority, seq.arrival_time


class PriorityWaiting:
    def __init__(self) -> None:
        # (priority, arrival, tie, seq): tie is unique, so a sequence itself is never compared
        self._entries: list[tuple[int, float, int, Sequence]] = []
        self._entry: dict[int, tuple[int, float, int, Sequence]] = {}  # id(seq) -> its entry
        self._ties = itertools.count(1)

    def _insert(self, seq: Sequence, tie: int) -> None:
        if id(seq) in self._entry:
            raise ValueError(f"sequence {seq.request_id}/{seq.seq_index} is queued already")
        entry = (*rank(seq), tie, seq)
        bisect.insort(self._entries, entry)
        self._entry[id(seq)] = entry

    def append(self, seq: Sequence) -> None:
        """Behind every sequence of its rank."""
        self._insert(seq, next(self._ties))

    def appendleft(self, seq: Sequence) -> None:
        """Ahead of every sequence of its rank (a preempted one goes on where it was)."""
        self._insert(seq, -next(self._ties))

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.append(seq)

    def remove(self, seq: Sequence) -> None:
        entry = self._entry.pop(id(seq), None)
        if entry is None:
            raise ValueError("sequence not in the waiting queue")
        i = bisect.bisect_left(self._entries, entry)
        del self._entries[i]

    def __getitem__(self, i: int) -> Sequence:
        return self._entries[i][-1]

    def __iter__(self) -> Iterator[Sequence]:
        return (entry[-1] for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq: object) -> bool:
        return id(seq) in self._entry

    def check_invariants(self) -> None:
        assert self._entries == sorted(self._entries, key=lambda e: e[:3]), "waiting queue out of order"
        assert len(self._entry) == len(self._entries)
        assert all(self._entry[id(e[-1])] is e for e in self._entries), "an entry is not indexed"
        assert all(e[:2] == rank(e[-1]) for e in self._entries), "a sequence's rank changed while queued"
