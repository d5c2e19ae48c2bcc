"""What the executor holds of each sequence, as sent by this scheduler, and what a step costs in bytes.

A request's sampling parameters (allowed ids, biases, bad words: up to hundreds of KB)
and its prompt (for repetition_penalty) travel once, with the first of its sequences
that a step names while the executor holds nothing of the request; every other sequence
brings its seed, and the output tokens the executor has not been sent yet (one a step)
when its sampling reads them. `ExecutorStates` mirrors the executor's cache
(services/executor/seq_states.py) exactly: a sequence that ends or is preempted is
released, and the next step tells the executor to forget it; `reset` (a new executor,
or one that lost steps) starts from nothing and the next step says so, so both sides
agree again whatever the executor held before.

`seq_cost` is an upper bound on the bytes a sequence adds to an ExecuteStep (each id at
most INT_BYTES in msgpack, below 2**32), so the scheduler can keep every step under its
byte budget without encoding it twice.
"""

from __future__ import annotations

import msgspec

from services.scheduler.sequence import Sequence
from shared.messages import ExecuteStep, ScheduledSeq

INT_BYTES = 5
# a ScheduledSeq's field names and empty values, plus room for its int fields at their largest
SEQ_BYTES = len(msgspec.msgpack.encode(ScheduledSeq("", [], 0, [], [], True, 0))) + 9 * 9
PAIR_BYTES = 1 + 2 * INT_BYTES  # a (src, dst) block pair


def state_bytes(req: Sequence) -> int:
    """What the executor is sent once for the request: its sampling and, if read, its prompt."""
    sampling = req.sampling
    prompt = INT_BYTES * req.num_prompt_tokens if sampling.repetition_penalty != 1 else 0
    return req.sampling_bytes + prompt


class ExecutorStates:
    def __init__(self) -> None:
        self._held: dict[str, dict[int, int]] = {}  # request id -> seq index -> output tokens sent
        self._released: list[tuple[str, int]] = []
        self._reset = True  # the first step clears whatever an executor held before this scheduler

    def __len__(self) -> int:
        return len(self._held)

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._held

    def held_seqs(self) -> set[tuple[str, int]]:
        """(request id, seq index) of every sequence the executor holds once the stamped step is in."""
        return {(rid, i) for rid, seqs in self._held.items() for i in seqs}

    def attach(self, seq: ScheduledSeq, req: Sequence) -> None:
        """Put into seq what the executor lacks of req's state, and count it as sent."""
        sampling = req.sampling  # first: a request whose sampling raises changes nothing here
        held = self._held.get(req.request_id)
        if held is None:
            held = self._held[req.request_id] = {}
            seq.sampling = sampling
            if sampling.repetition_penalty != 1:
                seq.prompt_token_ids = req.prompt_token_ids
        seq.seed = sampling.seed
        if sampling.needs_output:
            sent = held.get(req.seq_index, 0)
            seq.output_start = sent
            seq.output_token_ids = req.output_token_ids[sent:]
            held[req.seq_index] = req.num_output_tokens
        else:
            held.setdefault(req.seq_index, 0)

    def release(self, req: Sequence) -> None:
        """The sequence ended or lost its KV: the executor may forget it (with the next step)."""
        held = self._held.get(req.request_id)
        if held is not None and held.pop(req.seq_index, None) is not None:
            self._released.append((req.request_id, req.seq_index))
            if not held:
                del self._held[req.request_id]

    def reset(self) -> None:
        """The executor holds nothing we know of (it restarted, or steps were lost)."""
        self._held.clear()
        self._released.clear()
        self._reset = True

    def stamp(self, step: ExecuteStep) -> None:
        """The releases (and reset) due, onto the step about to be sent."""
        step.released, self._released = self._released, []
        step.reset_states, self._reset = self._reset, False

    def seq_cost(self, req: Sequence, num_tokens: int, block_size: int, new_requests: set[str]) -> int:
        """Bytes a chunk of num_tokens adds to a step, at most; new_requests: the requests whose
        state the step carries already."""
        # its block table covers at most its tokens (more only under a --kv-policy reserve-*
        # reservation, within the headroom the byte budget leaves), plus a block of slack
        blocks = max(len(req.block_table), -(-req.num_tokens // block_size)) + 1
        cost = SEQ_BYTES + len(req.request_id) + INT_BYTES * (3 * num_tokens + blocks) + PAIR_BYTES
        held = self._held.get(req.request_id)
        if held is None and req.request_id not in new_requests:
            cost += state_bytes(req)
        if req.sampling.needs_output:
            cost += INT_BYTES * (req.num_output_tokens - (held or {}).get(req.seq_index, 0))
        return cost

    @staticmethod
    def worst_cost(req: Sequence, max_num_batched_tokens: int, block_size: int) -> int:
        """The most one sequence of req can add to a step: its state, a whole chunk, its whole
        block table and output (a recompute)."""
        tokens = min(max_num_batched_tokens, req.max_total_tokens)
        blocks = -(-req.max_total_tokens // block_size) + 2
        return (SEQ_BYTES + len(req.request_id) + state_bytes(req) + PAIR_BYTES
                + INT_BYTES * (3 * tokens + blocks + req.params.max_tokens))
