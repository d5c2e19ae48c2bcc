"""The executor's cached request state: what the scheduler sends once per request or sequence.

A request's SeqSampling (its masks and biases can be hundreds of KB) and its prompt (for
repetition_penalty) come on the first step that names it; each sequence's output tokens
come as they are produced, from `output_start` on (see `ScheduledSeq`). `receive` takes a
step's releases, resets and new state before anything else can refuse the step; `fill`
then puts each row's whole sampling and histories into the step, in place, so that
`ModelRunner.run` reads a step as if everything had been sent.

The scheduler mirrors what it has sent (services/scheduler/executor_states.py) and
releases a sequence's state when it ends or is preempted, so what is held here is
bounded by its running sequences; MAX_REQUESTS caps it anyway, dropping the least
recently used. A row whose state is missing (never sent, dropped) does not fail its
step: `fill` gives it a neutral sampling and reports it in the list it returns, and the
executor answers -1 and the reason for that row alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec

from shared.messages import ExecuteStep, FailedRow, SeqSampling

log = logging.getLogger(__name__)

MAX_REQUESTS = 16384
NEUTRAL = SeqSampling(temperature=1.0, top_p=1.0, top_k=0, seed=None)


class _Seq:
    __slots__ = ("output", "sampling")

    def __init__(self, sampling: SeqSampling):
        self.sampling = sampling
        self.output: list[int] = []


class _Request:
    __slots__ = ("prompt", "sampling", "seqs")

    def __init__(self, sampling: SeqSampling, prompt: list[int]):
        self.sampling, self.prompt = sampling, prompt
        self.seqs: dict[int, _Seq] = {}


class SequenceStates:
    def __init__(self, max_requests: int = MAX_REQUESTS):
        self.max_requests = max_requests
        self._requests: OrderedDict[str, _Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._requests)

    def held_seqs(self) -> set[tuple[str, int]]:
        return {(rid, i) for rid, req in self._requests.items() for i in req.seqs}

    def receive(self, step: ExecuteStep) -> None:
        """Forget what the step releases (everything first, on reset_states); keep its new state."""
        if step.reset_states:
            self._requests.clear()
        for request_id, seq_index in step.released:
            req = self._requests.get(request_id)
            if req is not None:
                req.seqs.pop(seq_index, None)
                if not req.seqs:
                    del self._requests[request_id]
        for seq in step.seqs:
            if seq.sampling is not None:
                req = self._requests.get(seq.request_id)
                if req is None:
                    req = self._requests[seq.request_id] = _Request(seq.sampling, seq.prompt_token_ids)
                elif seq.prompt_token_ids:
                    req.prompt = seq.prompt_token_ids
                state = req.seqs.get(seq.seq_index)
                if state is None:
                    req.seqs[seq.seq_index] = state = _Seq(seq.sampling)
                state.sampling = seq.sampling
            else:
                req = self._requests.get(seq.request_id)
                if req is None:
                    continue  # reported by fill
                state = req.seqs.get(seq.seq_index)
                if state is None:
                    if seq.output_start:
                        continue  # its earlier tokens were never here: reported by fill
                    base = req.sampling
                    sampling = base if base.seed == seq.seed else msgspec.structs.replace(base, seed=seq.seed)
                    req.seqs[seq.seq_index] = state = _Seq(sampling)
            self._requests.move_to_end(seq.request_id)
            if seq.output_start <= len(state.output):
                del state.output[seq.output_start:]
                state.output.extend(seq.output_token_ids)
            else:  # a gap (tokens never sent here): the row fails in fill, and its request with it
                req.seqs.pop(seq.seq_index)
        while len(self._requests) > self.max_requests:
            request_id, _ = self._requests.popitem(last=False)
            log.warning("sequence states over %d requests: dropping %s's", self.max_requests, request_id)

    def fill(self, step: ExecuteStep) -> list[FailedRow]:
        """Each row's sampling (and the histories it reads), in place; the rows whose state this
        executor does not hold, failed (500)."""
        failed = []
        for i, seq in enumerate(step.seqs):
            req = self._requests.get(seq.request_id)
            state = req.seqs.get(seq.seq_index) if req is not None else None
            if state is None:
                failed.append(FailedRow(i, 500, f"the executor holds no sampling state for {seq.request_id!r} "
                                                f"(sample {seq.seq_index})"))
                seq.sampling = NEUTRAL
                continue
            sampling = seq.sampling = state.sampling
            if seq.sample and sampling.needs_output:
                seq.output_token_ids = state.output
                seq.prompt_token_ids = req.prompt if sampling.repetition_penalty != 1 else []
        return failed

