"""Pooling: an embedding request's prompt, through its last hidden states, to one unit vector.

The scheduler marks a step's rows of embedding requests (`ExecuteStep.pooling`: row, kind,
whether the chunk ends the prompt). The model returns the final normed hidden state of
every token of those rows (`LlamaForCausalLM.forward_pooled`); here each row adds to its
request's pooled state, and the rows that end their prompt give the vector: "mean" over
every prompt token, "last" the last token's, "cls" the first token's; L2-normalised,
as little-endian float32 bytes (`StepResult.embeddings`, in step order).

A prompt may come in chunks over several steps, so "mean" and "cls" keep a partial state
per request (a float32 sum and count, or the first token's state) until the prompt ends;
it is dropped when the scheduler releases the request (aborted, preempted) or resets. A
chunk that does not continue where the state left off (state lost, or a prompt taken
from the prefix cache, which the scheduler never does for these kinds) fails its row
alone rather than pool part of the prompt; a chunk at position 0 starts afresh (a
recompute after preemption). "last" needs no state: it takes prefix-cache hits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.messages import ExecuteStep


class _Partial:
    __slots__ = ("count", "next_pos", "total")

    def __init__(self, total: Tensor, count: int, next_pos: int):
        self.total, self.count, self.next_pos = total, count, next_pos


class Pooler:
    def __init__(self):
        self._partial: dict[str, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def release(self, step: ExecuteStep) -> None:
        """Forget the requests the step releases (every one on reset_states)."""
        if step.reset_states:
            self._partial.clear()
        for request_id, _ in step.released:
            self._partial.pop(request_id, None)

    @staticmethod
    def rows(step: ExecuteStep, query_lens: list[int]) -> list[int]:
        """The token rows (in the step's flattened tokens) of every pooling sequence."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return [r for i, _, _ in step.pooling for r in range(starts[i], starts[i + 1])]

    def pool(self, step: ExecuteStep, hidden: Tensor) -> tuple[list[bytes], dict[int, str]]:
        """hidden: the final normed hidden states of `rows(step)`, in order. The vectors of the
        rows that end their prompt (b"" where one fails) and the failed rows (index -> why)."""
        out: list[bytes] = []
        failed: dict[int, str] = {}
        offset = 0
        for i, kind, ends in step.pooling:
            seq = step.seqs[i]
            n = len(seq.token_ids)
            states = hidden[offset : offset + n].float()
            offset += n
            try:
                vector = self._add(seq.request_id, kind, seq.start_pos, states, ends)
            except ValueError as exc:
                failed[i] = str(exc)
                self._partial.pop(seq.request_id, None)
                vector = None
            if ends:
                out.append(b"" if vector is None else _unit_bytes(vector))
        return out, failed

    def _add(self, request_id: str, kind: str, start: int, states: Tensor, ends: bool) -> Tensor | None:
        if kind == "last":
            return states[-1] if ends else None
        partial = self._partial.get(request_id)
        if start == 0:
            partial = None  # a fresh start (first chunk, or recomputed after a preemption)
        elif partial is None or partial.next_pos != start:
            raise ValueError(f"pooling: the prompt's chunk at position {start} does not follow the state held "
                             f"({'none' if partial is None else partial.next_pos}); the embedding is not computed")
        if partial is None:
            total = states[0].clone() if kind == "cls" else states.sum(0)
            partial = _Partial(total, len(states), start + len(states))
        else:
            if kind == "mean":
                partial.total += states.sum(0)
            partial.count += len(states)
            partial.next_pos += len(states)
        if not ends:
            self._partial[request_id] = partial
            return None
        self._partial.pop(request_id, None)
        return partial.total if kind == "cls" else partial.total / partial.count


def _unit_bytes(vector: Tensor) -> bytes:
    v = torch.nn.functional.normalize(vector.float(), dim=0)
    return v.cpu().numpy().astype("<f4").tobytes()
