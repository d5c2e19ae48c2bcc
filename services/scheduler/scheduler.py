"""Iteration-level continuous batching over a paged KV pool.

In the paper's words (`sequence.py`): a request is a `SequenceGroup` (`groups`, by request
id) of one or more `Sequence`s (its n parallel samples or its beams), and the queues hold
sequences. A new sequence is admitted with one prefix-cache lookup
(`BlockManager.get_computed_blocks`) handed to its allocation (`allocate_slots`, None when
it does not fit); the host blocks of swapped-out sequences are a `HostBlockPool`.

Every step: running requests first (each needs its next token, or the next chunk
of its prompt), then waiting requests in arrival order while the token budget, the
running-request cap and free blocks allow. When blocks run out, the newest running
request is preempted: its blocks are freed and it is recomputed later (prompt and
generated tokens together), or, in swap mode while host swap space lasts, its KV is
copied to host memory and back when it resumes. A request that fits the pool alone
always finishes.
A swap-out is done only once its step succeeds: until then (`confirm_swaps`) its sequence
is not swapped back in, and if the step fails (`undo_swaps`) the host blocks, never
written, are freed and the sequence is recomputed instead.
The pool itself may change under it (`replace_pool`: an executor that came back with
another pool): every request then recomputes on the new one.
Under `scheduling_policy` "priority" (fcfs, the default, refuses a non-zero priority) both
queues are kept in the order of `priority_queue.rank`, (priority, arrival): the waiting
queue is a `PriorityWaiting` (a bisect insert each, no sort per step) and the running list
is inserted into in order, so the running loop serves higher priorities first and its
victim, the last, is the lowest priority and the latest arrival among equals. A waiting
sequence that finds no room (no KV blocks or no running slot) has the running sequence of
the lowest priority preempted for it, as above (recompute or swap), while that one's
priority is strictly lower (a larger value): never one of an equal or higher priority. A
victim that has a chunk in the step being built loses it and its block copies, and is
recomputed, not swapped (its table holds blocks taken for that chunk, maybe a copy-on-write
one that the step's copies, which run after swap-outs, would fill); after such a preemption
no sequence is swapped back in within that step, since a swap-in could overwrite a block
the step still copies from. `schedule_ahead` never preempts: when it would, the next step
is left to `schedule`. A low priority can wait as long as higher ones keep coming.
Requests whose gateway (`reply_to`) is in `held` (its replies cannot go out now) are
skipped: they keep their blocks but run no further until released.
A resumed request (its first engine was lost) comes with its output so far
(`Sequence.num_resumed_tokens`): it is admitted like a sequence preempted by recompute
(prompt and output computed again, the prefix cache looked up as usual) and generates on
from there, its seeds, max_tokens and min_tokens counting the whole output.
Each step stays under `max_step_bytes` encoded (a quarter of the largest message a
socket takes): sequences are added while their estimated bytes fit (`executor_states`),
and the rest wait for the next step; a request whose sequence alone could not fit is
refused at admission. Sampling parameters and token histories are sent once per
request and sequence (`ExecutorStates` mirrors what the executor holds).
LoRA adapters (`lora_slots`): a step runs at most `max_loras` distinct adapters. A running
sequence pins its adapter's slot; a waiting request whose adapter finds no slot is skipped
for this step (those behind it are admitted as usual), and each step names the slot of each
row and the adapter of each slot it uses.
A request whose own handling raises (scheduling it, applying its result, scoring its
beams) fails alone: its sequences end with "error", their blocks are freed, and
`take_failed` hands it to the caller to report; every other request goes on. So does
one whose row of a step the executor failed alone (`StepResult.failed`, see
`fail_rows`): the whole request ends (all its samples or beams), its blocks are freed,
and the step's other rows apply as usual.
Speculative decoding (`speculation.py`, off by default): a running sequence in a decode step
may carry proposed tokens after its last one (`ScheduledChunk.draft`), for which it takes
slots too (never preempting anyone for them); the result says how many the executor accepted,
the sequence goes on after those and the token sampled after them, and the slots of the
rejected ones are given back (`BlockManager.trim`, a block freed when its first slot goes).
Only verified tokens are committed to the prefix cache. Under a draft model the proposals are the
executor's: the chunk's draft holds placeholders until the result names them (`StepResult.proposed`).
A step built ahead never speculates,
and a sequence that may speculate, or whose step in flight speculates, is not stepped ahead.
Pure logic: it builds the step message but never touches a socket.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections import deque
from dataclasses import dataclass, replace
from itertools import pairwise

from services.scheduler import beam_search
from services.scheduler.block_manager import BlockManager
from services.scheduler.executor_states import ExecutorStates
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.lora_slots import LoraSlotTable
from services.scheduler.priority_queue import PriorityWaiting, rank
from services.scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from services.scheduler.speculation import PLACEHOLDER, SpeculativeConfig, Speculator
from services.scheduler.validation import request_problem, resume_problem, token_limit
from shared.messages import (
    PREVIOUS_TOKEN,
    ExecuteStep,
    FailedRow,
    PooledOutput,
    ScheduledSeq,
    SchedulerStats,
    TokenDelta,
    TokenLogprob,
)
from shared.transport import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    preemption_mode: str = "recompute"  # or "swap"
    vocab_size: int = 0  # the model's, from ExecutorReady (0: unknown); token ids are checked against it
    # an ExecuteStep's encoded size stays under this (estimated); block moves are not counted,
    # so leave room for them below the socket's limit
    max_step_bytes: int = MAX_MESSAGE_BYTES // 4
    scheduling_policy: str = "fcfs"  # or "priority" (see the module doc)
    max_loras: int = 4  # distinct LoRA adapters a step may run (the executor's slots)
    speculative: SpeculativeConfig = SpeculativeConfig()


@dataclass(frozen=True)
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int
    restored: bool = False  # its computed KV comes back from swap space in this step
    draft: tuple[int, ...] = ()  # proposed tokens after its last one (speculative decoding)

    @property
    def proposed_by_executor(self) -> bool:
        """Its draft is placeholders for the executor's draft model's proposals."""
        return bool(self.draft) and self.draft[0] == PLACEHOLDER

    @property
    def num_slots(self) -> int:
        """Positions it computes this step: its tokens and its proposed ones."""
        return self.num_tokens + len(self.draft)

    @property
    def samples(self) -> bool:
        r = self.sequence
        return r.num_computed_tokens + self.num_tokens == r.num_tokens


def _computes_a_prompt(chunks: list[ScheduledChunk]) -> bool:
    """Whether the step already computes part of a prompt (a sequence with more than its newest
    token left to compute); then a waiting prompt that the budget would cut is not started in it.

    Its chunk would lengthen the step, and so delay that other prompt's first token, while giving
    it no token of its own: it would finish only in a later step, which would in turn carry the
    next prompt's first chunk. Started in a step without another prompt, each queued prompt
    finishes as soon as the ones before it allow. A prompt that fits what is left of the budget
    is still added, as is any prompt to a step of decodes alone."""
    return any(c.sequence.num_uncomputed_tokens > 1 for c in chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, swap: HostBlockPool | None = None):
        self.config = config
        self.blocks = block_manager
        self.swap = swap if config.preemption_mode == "swap" else None
        self.num_swapped_out_total = 0
        self.num_swapped_in_total = 0
        self.num_forked_at_admission = 0  # requests forked with no chunk (the cache held their prompt)
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: deque[Sequence] | PriorityWaiting = PriorityWaiting() if self.by_priority else deque()
        self.running: list[Sequence] = []
        self.groups: dict[str, SequenceGroup] = {}  # request id -> its samples or beams
        self.num_preemptions_total = 0
        self.num_steps_total = 0
        self.decode_steps_total = 0
        self.decode_step_seconds_total = 0.0
        self.decode_forward_seconds_total = 0.0
        # random start: a late result for a step of a previous scheduler process (the
        # executor outlives it) never matches a step of this one
        self._next_step_id = random.getrandbits(48)
        self._failed: list[Sequence] = []  # failed, not yet reported (see take_failed)
        self._doomed: list[Sequence] = []  # failed while a step is being built: freed after it
        self._swap_outs: dict[int, list[Sequence]] = {}  # step id -> sequences it swaps out, until answered
        self.held: set[bytes] = set()  # gateways whose requests wait (backpressure)
        self.executor_states = ExecutorStates()  # what the executor holds of each sequence
        self._step_bytes = 0  # of the step being built, estimated
        self._step_new: set[str] = set()  # requests whose state the step being built carries
        self._step_preempted_for_priority = False  # then the step being built swaps nothing in
        self._priority_blocked = False  # schedule_ahead left a preemption for priority to `schedule`
        self.loras = LoraSlotTable(config.max_loras)
        self._lora_pinned: set[str] = set()  # digests of the adapters the step being built may not evict
        self._lora_skipped: set[int] = set()  # ids of waiting sequences whose adapter found no slot this step
        self.speculator = Speculator(config.speculative)

    # --- requests in and out -------------------------------------------------------

    def check_fits(self, req: Sequence) -> str | None:
        """Why a request can never run on this pool, or None if it can."""
        problem = request_problem(req.prompt_token_ids, req.params, req.arrival_time, self.config.vocab_size,
                                  req.eos_token_ids)
        if problem is None and req.num_resumed_tokens:
            problem = resume_problem(req.num_prompt_tokens, req.output_token_ids[: req.num_resumed_tokens],
                                     req.params, self.config.max_model_len, self.config.vocab_size)
        if problem is None and req.priority and not self.by_priority:
            problem = "priority needs a scheduler started with --scheduling-policy priority (this one is fcfs)"
        if problem is not None:
            return problem
        if req.max_total_tokens > self.config.max_model_len:
            return (
                f"prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({req.params.max_tokens}) "
                f"exceeds the maximum context length of {self.config.max_model_len} tokens"
            )
        need = self.blocks.blocks_for(req.max_total_tokens)
        if need > self.blocks.max_sequence_blocks:
            whole = ("the whole KV cache holds" if self.blocks.max_sequence_blocks == self.blocks.num_blocks
                     else "the largest contiguous reservation holds")
            return (
                f"the request needs up to {need} KV blocks but {whole} "
                f"{self.blocks.max_sequence_blocks}; lower max_tokens or the prompt length"
            )
        worst = self.executor_states.worst_cost(req, self.config.max_num_batched_tokens, self.blocks.block_size)
        if worst > self.config.max_step_bytes:
            return (
                f"the request's sampling parameters and prompt (allowed_token_ids, logit_bias, bad_words: "
                f"{req.sampling_bytes} bytes encoded) would make a model step of up to {worst} bytes, over the "
                f"{self.config.max_step_bytes} bytes a step may take; send fewer of them"
            )
        return None

    def add_request(self, req: Sequence) -> SequenceGroup:
        """Queue a new request, given as its first sequence; returns its group."""
        if req.request_id in self.groups:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        group = self.groups[req.request_id] = SequenceGroup.start(req)
        self.waiting.extend(group.seqs)
        return group

    def finish_request(self, request_id: str, reason: str, seq_index: int | None = None) -> Sequence | None:
        """End a request's sequences now (abort, stop string), or only one of them;
        frees their blocks. Returns a sequence of it, or None if it is unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        ended = [r for r in group.seqs if seq_index is None or r.seq_index == seq_index]
        for req in ended:
            self._finish(req, reason)
        return ended[0] if ended else group.seqs[0]

    def _finish(self, req: Sequence, reason: str) -> None:
        if req.status is SequenceStatus.RUNNING:
            self.running.remove(req)
        elif req.status is SequenceStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        if self.swap is not None:
            self.swap.free(req.swapped_blocks)
        req.status = SequenceStatus.FINISHED
        req.finish_reason = reason
        req.pending_forks = 0
        self.executor_states.release(req)
        group = self.groups.get(req.request_id)
        if group is not None and group.is_finished:
            del self.groups[req.request_id]
        elif group is not None and group.beam is not None:
            group.seqs.remove(req)  # a dropped beam: its search no longer needs it

    def fail_request(self, request_id: str, exc: BaseException) -> None:
        """End a request whose handling raised: every sequence, blocks freed; reported
        by `take_failed`."""
        group = self.groups.get(request_id)
        if group is not None and group.seqs:
            self._doom(group.seqs[0], exc)
            self._release_doomed()

    def take_failed(self) -> list[Sequence]:
        """Requests that failed since the last call (finish_reason "error"), once each."""
        failed, self._failed = self._failed, []
        return failed

    def _doom(self, req: Sequence, exc: BaseException) -> None:
        """Take a failed request's sequences out of every queue; their blocks are freed by
        `_release_doomed`, after any step being built (which may not reuse them)."""
        log.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
        group = self.groups.pop(req.request_id, None)
        seqs = group.seqs if group is not None else [req]
        for seq in seqs if req in seqs else [*seqs, req]:
            self.executor_states.release(seq)
            for queue in (self.running, self.waiting):
                if seq in queue:
                    queue.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "error"
            seq.pending_forks = 0
            self._doomed.append(seq)
        self._failed.append(req)

    def _release_doomed(self) -> None:
        for seq in self._doomed:
            try:
                self.blocks.free(seq)
                if self.swap is not None:
                    self.swap.free(seq.swapped_blocks)
            except Exception:  # the pool may be off by a block; the stage goes on
                log.exception("freeing the blocks of failed request %s", seq.request_id)
        self._doomed.clear()

    def _preempt(self, req: Sequence, swap_out: list[tuple[int, int]] | None = None) -> None:
        """Free a running request's blocks; swap its KV out if swap_out collects copies
        and there is room, else it is recomputed later."""
        if (swap_out is not None and self.swap is not None and req.params.pooling is None
                and self.swap.can_swap_out(len(req.block_table))):  # (a pooling sum is not swapped)
            pairs = self.swap.swap_out(req.block_table)
            swap_out.extend(pairs)
            req.swapped_blocks = [host for _, host in pairs]
            self._swap_outs.setdefault(self._next_step_id, []).append(req)  # the step being built
            self.num_swapped_out_total += 1
        else:
            req.num_computed_tokens = 0
        self.blocks.free(req)
        self.executor_states.release(req)
        req.status = SequenceStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        log.info("preempted %s (%s)", req.request_id, "swapped out" if req.swapped_blocks else "recompute later")

    def preempt_all(self) -> None:
        """Every request loses its KV, swapped or not (e.g. the executor restarted)."""
        for req in reversed(self.running):
            self._preempt(req)
        self.running.clear()
        for req in self.waiting:
            if req.swapped_blocks:
                self.swap.free(req.swapped_blocks)
                req.num_computed_tokens = 0
        self._swap_outs.clear()
        self.blocks.reset_cache()
        self.executor_states.reset()  # the executor restarted or lost steps: every state goes again

    def replace_pool(self, blocks: BlockManager, swap: HostBlockPool | None, config: SchedulerConfig,
                     ) -> list[tuple[Sequence, str]]:
        """Go on with another pool (block count, block size, swap space, context length):
        every request loses its KV and is recomputed there. Those the new pool can never
        hold end ("error") and are returned with why."""
        self.preempt_all()
        self.blocks, self.config = blocks, config
        self.swap = swap if config.preemption_mode == "swap" else None
        ended = []
        for request_id, group in list(self.groups.items()):
            for seq in group.seqs:
                seq.block_hashes.clear()  # digests of blocks of the old size
            first = group.seqs[0]
            problem = self.check_fits(first)
            if problem is not None:
                self.finish_request(request_id, "error")
                ended.append((first, problem))
        return ended

    def confirm_swaps(self, step_id: int) -> None:
        """Step step_id succeeded: the KV it swapped out is in host memory."""
        self._swap_outs.pop(step_id, None)

    def undo_swaps(self, step_id: int) -> None:
        """Step step_id failed, maybe before its swaps ran: the host blocks it was to write
        hold nothing, so the sequences it swapped out free them and are recomputed."""
        for req in self._swap_outs.pop(step_id, []):
            if req.status is SequenceStatus.WAITING and req.swapped_blocks:
                self.swap.free(req.swapped_blocks)
                req.num_computed_tokens = 0

    def _fork(self, parent: Sequence) -> None:
        """Parallel samples share every block the parent has computed so far."""
        for i in range(parent.params.n - parent.pending_forks, parent.params.n):
            child = parent.spawn(i)
            self.blocks.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.groups[parent.request_id].seqs.append(child)
            self._add_running(child)
        parent.pending_forks = 0

    def _add_running(self, req: Sequence) -> None:
        """Into the running list: at the end, or under the priority policy behind those of its rank or better."""
        if self.by_priority:
            bisect.insort_right(self.running, req, key=rank)
        else:
            self.running.append(req)

    def fail_rows(self, chunks: list[ScheduledChunk], failed: list[FailedRow]) -> list[tuple[Sequence, FailedRow]]:
        """End the requests of the step's rows the executor failed alone, before the result is
        applied (their rows are then skipped); a request with several failed rows ends once.
        Returns each ended request with the row that ended it."""
        out = []
        for row in failed:
            req = chunks[row.index].sequence
            group = self.groups.get(req.request_id)
            if req.is_finished or group is None or req not in group.seqs:
                continue  # it ended while the step ran
            log.warning("request %s failed in the executor (%d): %s", req.request_id, row.status, row.message)
            ended = self.finish_request(req.request_id, "error")
            if ended is not None:
                out.append((ended, row))
        return out

    # --- one step --------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> tuple[ExecuteStep, list[ScheduledChunk]] | None:
        """The next step. Called only once every step before it has been answered (its
        result applied, or `undo_swaps` after it failed), so their swap-outs are done.

        None means nothing can run until something changes (the stage then sleeps until a
        message comes). An admission can fork a request whose prompt the cache holds up to
        the fork point without giving it a chunk: when that leaves the step empty, its
        samples are running now and are scheduled at once rather than after the next
        message (found by the pipelined random-workload test)."""
        forks = self.num_forked_at_admission
        step = self._schedule_once()
        if step is None and self.num_forked_at_admission != forks:
            step = self._schedule_once()
        return step

    def _schedule_once(self) -> tuple[ExecuteStep, list[ScheduledChunk]] | None:
        self._swap_outs.clear()
        self._priority_blocked = False
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        copies: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted = False  # then nothing is admitted, so no step both swaps out and in
        full = False  # the step's byte budget is spent: nothing more is added
        self._start_step()

        in_step: set[int] = set()  # ids of the requests with a chunk in this step
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if id(req) in in_step or req.reply_to in self.held:  # (in_step: after a failure restarted the scan)
                i += 1
                continue
            try:
                n = self._chunk_size(req, req.num_computed_tokens, budget)
                if n == 0:  # a beam waiting for its siblings' candidates
                    i += 1
                    continue
                draft = self._draft(req, budget - n) if n == 1 else []
                if not self._fits_bytes(req, n + len(draft)):
                    full = True
                    break
                if draft:
                    copies += self.blocks.append_slots(req, n + len(draft))
                    chunks.append(ScheduledChunk(req, n, draft=tuple(draft)))
                    in_step.add(id(req))
                    budget -= n + len(draft)
                    i += 1
                    continue
                while not self.blocks.can_append(req, n):
                    idle = self._idle_beam(chunks)
                    if idle is not None:  # blocks nobody computes with this step go first
                        if self.running.index(idle) < i:
                            i -= 1
                        self._yield_idle_beam(idle)
                        continue
                    victim = self.running.pop()
                    self._preempt(victim, swap_out)
                    preempted = True
                    if victim is req:
                        break
                else:
                    copies += self.blocks.append_slots(req, n)
                    chunks.append(ScheduledChunk(req, n))
                    in_step.add(id(req))
                    budget -= n
                    i += 1
                    continue
                break
            except Exception as exc:
                self._doom(req, exc)  # its siblings may sit before i: scan again from the start
                i = 0

        if not preempted and not full:
            self._admit_waiting(budget, chunks, swap_in, copies, swap_out)
        return self._assemble(chunks, self._seqs(chunks), copies, swap_out, swap_in)

    def _draft(self, req: Sequence, budget: int) -> list[int]:
        """Proposed tokens for a running sequence's decode step, if their slots fit without
        preempting anyone; [] otherwise."""
        if not isinstance(self.blocks, BlockManager):  # the reservation baselines keep no rollback
            return []
        draft = self.speculator.propose(req, len(self.running), budget, self.config.max_model_len)
        return draft if draft and self.blocks.can_append(req, 1 + len(draft)) else []

    def _may_speculate(self, req: Sequence) -> bool:
        """Whether req's next step may speculate: then it is not built ahead (without proposals)."""
        return (isinstance(self.blocks, BlockManager) and self.speculator.active(len(self.running))
                and req.speculation_allowed)

    def schedule_ahead(self, in_flight: list[ScheduledChunk]) -> tuple[ExecuteStep, list[ScheduledChunk]] | None:
        """The step after the one in flight, built before its result is back (async
        scheduling), so that the executor starts it as soon as it is done with that one.

        Each running sequence that samples in the step in flight runs the token it samples
        there (`PREVIOUS_TOKEN`, which the executor fills in), one position further on;
        waiting requests are admitted as in `schedule`. It never preempts: a sequence that
        finishes by length with that token, or finds no room, is left out. None, with
        nothing changed, when a running sequence needs the result first: it did not
        sample in that step (a prompt chunk, a new fork, a sequence left out before), or its
        sampling reads its own output (penalties, grammars, bad words) or is a beam's. The
        step after that result is then built by `schedule`, which may preempt.

        The results apply as `schedule`'s do, in step order: by the time this step's
        result comes, the one in flight has added its token, and each of this step's
        chunks is an ordinary one-token decode chunk. A sequence that the earlier result
        finished (EOS, a stop token) computed one token for nothing, and its chunk here is
        skipped like any sequence that ended while its step ran.
        """
        going = None if self._priority_blocked else self._ahead_of(in_flight)
        if going is None:
            return None
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        seqs: list[ScheduledSeq | None] = []
        copies: list[tuple[int, int]] = []
        self._start_step()
        for req, start in going:
            n = start + 1 - req.num_computed_tokens  # the tokens in flight, then this one
            if budget <= 0 or not self.blocks.can_append(req, n) or not self._fits_bytes(req, n):
                continue
            copies += self.blocks.append_slots(req, n)
            chunks.append(ScheduledChunk(req, 1))
            seqs.append(self._ahead_seq(req, start))
            budget -= 1
        admitted: list[ScheduledChunk] = []
        swap_in: list[tuple[int, int]] = []
        self._admit_waiting(budget, admitted, swap_in)
        return self._assemble(chunks + admitted, seqs + self._seqs(admitted), copies, [], swap_in)

    def _ahead_of(self, in_flight: list[ScheduledChunk]) -> list[tuple[Sequence, int]] | None:
        """The running sequences `schedule_ahead` can step, each with the position its next
        token goes to; None when one of them must wait for the result in flight."""
        sampling = {id(c.sequence): c for c in in_flight if c.samples}
        going = []
        for req in self.running:
            if req.reply_to in self.held:
                continue  # not stepped by either kind of step until released
            chunk = sampling.get(id(req))
            if chunk is None or req.pending_forks or req.params.use_beam_search or req.sampling.needs_output:
                return None
            if chunk.draft or self._may_speculate(req):  # its accepted count is unknown, or it may propose
                return None
            # its token in flight is its last (max_tokens, or the context is full): nothing after it
            if req.num_output_tokens + 1 < req.params.max_tokens and req.num_tokens + 1 < self.config.max_model_len:
                going.append((req, req.num_computed_tokens + chunk.num_tokens))
        return going

    def _ahead_seq(self, req: Sequence, start: int) -> ScheduledSeq:
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=[PREVIOUS_TOKEN],
            start_pos=start,
            block_table=list(req.block_table),
            slot_mapping=self.blocks.slot_mapping(req, start, 1),
            sample=True,
            output_index=req.num_output_tokens + 1,
            prompt_logprobs=req.params.prompt_logprobs or 0,
            seq_index=req.seq_index,
        )
        self.executor_states.attach(seq, req)  # its sampling reads no output (else it would not run ahead)
        return seq

    def _start_step(self) -> None:
        self._step_bytes = 0
        self._step_new.clear()
        self._step_preempted_for_priority = False
        self._lora_pinned = {r.params.lora.digest for r in self.running if r.params.lora is not None}
        self._lora_skipped.clear()

    def _fits_bytes(self, req: Sequence, num_tokens: int) -> bool:
        """Whether a chunk of num_tokens of req keeps the step being built under max_step_bytes
        (then it is counted). A step's first chunk always fits: admission saw that it can."""
        cost = self._step_cost(req, num_tokens)
        if cost is None:
            return False
        self._count_step_cost(req, cost)
        return True

    def _step_cost(self, req: Sequence, num_tokens: int) -> int | None:
        """The estimated bytes a chunk of num_tokens of req adds to the step being built, or
        None if they would take it past max_step_bytes; nothing is counted yet."""
        cost = self.executor_states.seq_cost(req, num_tokens, self.blocks.block_size, self._step_new)
        if self._step_bytes and self._step_bytes + cost > self.config.max_step_bytes:
            return None
        return cost

    def _count_step_cost(self, req: Sequence, cost: int) -> None:
        self._step_bytes += cost
        if not self.executor_states.holds_request(req.request_id):
            self._step_new.add(req.request_id)

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk], swap_in: list[tuple[int, int]],
                       copies: list[tuple[int, int]] | None = None,
                       swap_out: list[tuple[int, int]] | None = None) -> None:
        """Admit waiting sequences in order while the budget, the running cap and the pool allow;
        under the priority policy one that finds no room has lower priorities preempted for it
        (`_preempt_for`), when swap_out is given (by `schedule`, not `schedule_ahead`)."""
        while self.waiting and budget > 0:
            req = self._next_waiting()
            if req is None:
                break
            if req.params.lora is not None and not self._lora_slot(req):
                self._lora_skipped.add(id(req))
                continue
            if len(self.running) >= self.config.max_num_seqs:
                admitted = None
            else:
                try:
                    admitted = self._admit(req, budget, chunks, swap_in)
                except Exception as exc:
                    self._doom(req, exc)
                    continue
            if admitted is None:  # no room: a running slot or KV blocks
                given = self._preempt_for(req, chunks, copies, swap_out, swap_in)
                if given is None:
                    break
                budget += given
                continue
            if not admitted:
                break
            if chunks and chunks[-1].sequence is req:
                budget -= chunks[-1].num_tokens

    def _preempt_for(self, req: Sequence, chunks: list[ScheduledChunk], copies: list[tuple[int, int]] | None,
                     swap_out: list[tuple[int, int]] | None, swap_in: list[tuple[int, int]]) -> int | None:
        """Priority policy: preempt the last running sequence (the lowest priority, the latest
        arrival among equals) for req, which found no room, if its priority is strictly lower.
        A chunk of it in this step is taken out, with its block copies. Returns the tokens it
        gives back to the step's budget; None when nothing may give way (always under fcfs)."""
        if not self.by_priority or not self.running or self.running[-1].priority <= req.priority:
            return None
        if swap_out is None:  # schedule_ahead never preempts: the step after it is built by schedule
            self._priority_blocked = True
            return None
        victim = self.running.pop()
        given = 0
        index = next((k for k, c in enumerate(chunks) if c.sequence is victim), None)
        if index is not None:
            given = chunks.pop(index).num_slots
            held = set(victim.block_table)
            copies[:] = [(src, dst) for src, dst in copies if dst not in held]
        # Swapped out only if it has no chunk in this step: else its table holds blocks taken for
        # that chunk, and maybe a copy-on-write block the step's copies (after swap-outs) would fill.
        # Nor after a swap-in of this step, which may have freed the host blocks a swap-out takes.
        self._preempt(victim, None if index is not None or swap_in else swap_out)
        self._step_preempted_for_priority = True
        log.info("preempted %s (priority %d) for %s (priority %d)", victim.request_id, victim.priority,
                 req.request_id, req.priority)
        return given

    def _seqs(self, chunks: list[ScheduledChunk]) -> list[ScheduledSeq | None]:
        """The step's entries of these chunks; None for one whose request failed building it."""
        seqs = []
        for c in chunks:
            if c.sequence.is_finished:  # a sibling failed before it: dropped from the step
                seqs.append(None)
                continue
            try:
                seqs.append(self._seq(c))
            except Exception as exc:
                self._doom(c.sequence, exc)
                seqs.append(None)
        return seqs

    def _assemble(self, chunks: list[ScheduledChunk], seqs: list[ScheduledSeq | None], copies: list[tuple[int, int]],
                  swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                  ) -> tuple[ExecuteStep, list[ScheduledChunk]] | None:
        # A failure drops every chunk of its request; the failed request's blocks are
        # freed only now, so no other sequence of this step was given one of them.
        kept = [(seq, c) for seq, c in zip(seqs, chunks, strict=True) if not c.sequence.is_finished]
        self._release_doomed()
        if not kept and not swap_out:
            return None
        chunks = [c for _, c in kept]
        rows, lora_slots = self.loras.step_slots([c.sequence.params.lora for c in chunks])
        for (seq, _), slot in zip(kept, rows, strict=True):
            seq.lora_slot = slot
        step = ExecuteStep(step_id=self._next_step_id, seqs=[seq for seq, _ in kept], block_copies=copies,
                           swap_out=swap_out, swap_in=swap_in,
                           pooling=[(i, c.sequence.params.pooling, c.samples) for i, c in enumerate(chunks)
                                    if c.sequence.params.pooling is not None],
                           lora_slots=lora_slots)
        self.executor_states.stamp(step)
        self._next_step_id += 1
        return step, chunks

    def _next_waiting(self) -> Sequence | None:
        if not self.held and not self._lora_skipped:
            return self.waiting[0]
        return next((r for r in self.waiting if r.reply_to not in self.held and id(r) not in self._lora_skipped),
                    None)

    def _lora_slot(self, req: Sequence) -> bool:
        """Whether req's adapter has (or now takes) a slot; it is then pinned for this step."""
        if self.loras.assign(req.params.lora, self._lora_pinned) is None:
            return False
        self._lora_pinned.add(req.params.lora.digest)
        return True

    def _admit(self, req: Sequence, budget: int, chunks: list[ScheduledChunk],
               swap_in: list[tuple[int, int]]) -> bool | None:
        """Start the first waiting sequence if it fits (or make room by preempting an
        idle beam); None when it finds no KV blocks, False when nothing more can be
        admitted this step for another reason."""
        restoring = bool(req.swapped_blocks)
        if restoring and any(req in reqs for reqs in self._swap_outs.values()):
            return False  # its swap-out is in the step in flight, not known to be done
        if restoring and self._step_preempted_for_priority:
            return False  # it could be swapped into a block this step's copies still read
        if restoring:
            n = self._chunk_size(req, req.num_computed_tokens, budget)
            if not self.blocks.can_restore(req, n):
                return self._preempt_idle_beam(chunks) or None
            if n and not self._fits_bytes(req, n):
                return False
            swap_in.extend(zip(req.swapped_blocks, self.blocks.restore(req, n), strict=True))
            self.swap.free(req.swapped_blocks)
            self.num_swapped_in_total += 1
        else:
            computed = self.blocks.get_computed_blocks(req)  # the one prefix lookup of this admission
            cached = len(computed) * self.blocks.block_size
            n = self._chunk_size(req, cached, budget)
            if n < self._chunk_size(req, cached, req.num_tokens) and _computes_a_prompt(chunks):
                return False  # the budget would cut it: see _computes_a_prompt
            cost = self._step_cost(req, n) if n else None
            if n and cost is None:  # over the step's bytes: checked before anything is allocated
                return False
            if self.blocks.allocate_slots(req, n, computed) is None:
                return self._preempt_idle_beam(chunks) or None
            if n:
                self._count_step_cost(req, cost)
            if req.num_preemptions == 0 and req.num_output_tokens == req.num_resumed_tokens:
                req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        self.waiting.remove(req)
        req.status = SequenceStatus.RUNNING
        self._add_running(req)
        if n == 0:  # the cache already holds everything before the fork point
            self._fork(req)
            self.num_forked_at_admission += 1
        else:
            chunks.append(ScheduledChunk(req, n, restored=restoring))
        return True

    def _preempt_idle_beam(self, chunks: list[ScheduledChunk]) -> bool:
        """A beam that waits for its siblings' candidates holds blocks it does not use
        now; when a waiting sequence (maybe that very sibling) cannot get blocks, such a
        beam gives its blocks up (it keeps its candidates) and goes to the back."""
        idle = self._idle_beam(chunks)
        if idle is not None:
            self._yield_idle_beam(idle)
        return idle is not None

    def _idle_beam(self, chunks: list[ScheduledChunk]) -> Sequence | None:
        scheduled = {id(c.sequence) for c in chunks}
        return next((r for r in reversed(self.running) if r.candidates is not None and id(r) not in scheduled), None)

    def _yield_idle_beam(self, req: Sequence) -> None:
        self.running.remove(req)
        self._preempt(req)
        self.waiting.remove(req)
        self.waiting.append(req)

    @staticmethod
    def _chunk_size(req: Sequence, computed: int, budget: int) -> int:
        """Tokens to compute this step; a sequence about to fork stops at its fork point."""
        n = min(req.num_tokens - computed, budget)
        if req.pending_forks:
            n = min(n, req.fork_at - computed)
        return n

    def _seq(self, chunk: ScheduledChunk) -> ScheduledSeq:
        req, start = chunk.sequence, chunk.sequence.num_computed_tokens
        executor_draft = chunk.proposed_by_executor
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.token_ids(start, start + chunk.num_tokens) + ([] if executor_draft else list(chunk.draft)),
            start_pos=start,
            block_table=list(req.block_table),
            slot_mapping=self.blocks.slot_mapping(req, start, chunk.num_slots),
            sample=chunk.samples and req.params.pooling is None,
            output_index=req.num_output_tokens,
            num_logprobs=2 * req.params.beam_width if req.params.use_beam_search else 0,
            score_targets=req.score_targets(start, chunk.num_tokens),
            prompt_logprobs=req.params.prompt_logprobs or 0,
            seq_index=req.seq_index,
            draft_token_ids=[] if executor_draft else list(chunk.draft),
            num_proposals=len(chunk.draft) if executor_draft else 0,
        )
        self.executor_states.attach(seq, req)
        return seq

    @staticmethod
    def expected_drafts(chunks: list[ScheduledChunk]) -> list[int]:
        """The draft lengths of the chunks that speculate, in step order: the result's
        num_accepted has one count for each, at most its length."""
        return [len(c.draft) for c in chunks if c.draft]

    @staticmethod
    def expected_proposals(chunks: list[ScheduledChunk]) -> int:
        """How many proposal lists (`StepResult.proposed`) the result of a step of these chunks holds."""
        return sum(1 for c in chunks if c.proposed_by_executor)

    @staticmethod
    def expected_outputs(chunks: list[ScheduledChunk], num_accepted: list[int] = ()) -> tuple[int, int, int]:
        """How many beam candidate lists, sampled-token logprobs and scored-prompt lists the
        result of a step of these chunks must hold (before it is applied); a speculating chunk
        has a logprob for each accepted draft token too (num_accepted, as `expected_drafts`)."""
        beams = sum(1 for c in chunks if c.samples and c.sequence.params.use_beam_search)
        accepted = iter(num_accepted)
        logprobs = sum(1 + (next(accepted, 0) if c.draft else 0) for c in chunks
                       if c.samples and c.sequence.sampling.logprobs is not None
                       and not c.sequence.params.use_beam_search)
        scored = sum(1 for c in chunks if c.sequence.score_targets(c.sequence.num_computed_tokens, c.num_tokens))
        return beams, logprobs, scored

    def process_results(
        self, chunks: list[ScheduledChunk], sampled: list[int], top_logprobs: list[list[tuple[int, float]]] = (),
        logprobs: list[TokenLogprob] = (), prompt_logprobs: list[list[TokenLogprob]] = (),
        embeddings: list[bytes] = (), num_accepted: list[int] = (), proposed: list[list[int]] = (),
    ) -> list[tuple[Sequence, TokenDelta | PooledOutput]]:
        """Apply one step's sampled tokens (and beams' candidates, the sampled tokens' logprobs,
        the scored prompt positions, the pooled vectors of embedding requests whose prompt
        ends, the accepted counts of speculating sequences and the executor's proposals, each
        given in step order for the sequences that have them); returns the deltas to send, by request."""
        self.num_steps_total += 1
        out: list[tuple[Sequence, TokenDelta | PooledOutput]] = []
        candidates, token_lps, scored = iter(top_logprobs), iter(logprobs), iter(prompt_logprobs)
        pooled, accepted_counts, proposals = iter(embeddings), iter(num_accepted), iter(proposed)
        touched_beams = set()
        for chunk, token in zip(chunks, sampled, strict=True):
            req = chunk.sequence
            samples = chunk.samples
            accepted = next(accepted_counts) if chunk.draft else 0
            proposal = next(proposals, None) if chunk.proposed_by_executor else None
            beam_cands = next(candidates) if samples and req.params.use_beam_search else None
            token_lp = ([next(token_lps) for _ in range(1 + accepted)] if samples and req.sampling.logprobs is not None
                        and not req.params.use_beam_search else None)
            positions = next(scored) if req.score_targets(req.num_computed_tokens, chunk.num_tokens) else None
            embedding = next(pooled) if samples and req.params.pooling is not None else None
            if req.status is not SequenceStatus.RUNNING:
                continue  # aborted, finished, failed or preempted while the step ran
            try:
                if chunk.proposed_by_executor:
                    chunk = self._with_proposal(chunk, proposal)
                if positions is not None:
                    req.add_prompt_logprobs(req.num_computed_tokens, positions)
                if embedding is not None:
                    delta = self._apply_pooled(chunk, embedding)
                else:
                    delta = self._apply(chunk, token, beam_cands, token_lp, accepted)
            except Exception as exc:
                self.fail_request(req.request_id, exc)
                continue
            if beam_cands is not None:
                touched_beams.add(req.request_id)
            elif delta is not None:
                out.append((req, delta))
        for request_id in touched_beams:
            try:
                out += self._advance_beams(request_id)
            except Exception as exc:
                self.fail_request(request_id, exc)
        # a request that failed after some of its sequences' deltas: the error is its last word
        return [(req, delta) for req, delta in out if req.finish_reason != "error"]

    def _with_proposal(self, chunk: ScheduledChunk, proposal: list[int] | None) -> ScheduledChunk:
        """chunk with the executor's proposals in place of its placeholders (ValueError if they do not fit)."""
        top = token_limit(self.config.vocab_size)
        if proposal is None or len(proposal) != len(chunk.draft) or any(not 0 <= t <= top for t in proposal):
            raise ValueError(f"the executor's proposals {proposal} do not fill {len(chunk.draft)} proposed slots "
                             f"with token ids of the vocabulary (0 to {top})")
        return replace(chunk, draft=tuple(proposal))

    def _apply(self, chunk: ScheduledChunk, token: int, beam_cands: list | None,
               token_lps: list[TokenLogprob] | None = None, num_accepted: int = 0) -> TokenDelta | None:
        """One sequence's share of a step's result; the delta to send, if any. A speculating
        chunk produced its first num_accepted draft tokens, then token (token_lps: one logprob
        each, when asked); a stop among them ends it there."""
        req = chunk.sequence
        samples = chunk.samples
        if samples:  # a forged or broken result fails its request, before anything changes
            top = token_limit(self.config.vocab_size)
            if beam_cands is None and not 0 <= token <= top:
                raise ValueError(f"the executor sampled token id {token}, outside the vocabulary (0 to {top})")
            if beam_cands is not None and any(not 0 <= t <= top for t, _ in beam_cands):
                raise ValueError(f"a beam candidate's token id is outside the vocabulary (0 to {top})")
            if not 0 <= num_accepted <= len(chunk.draft):
                raise ValueError(f"the executor accepted {num_accepted} of {len(chunk.draft)} proposed tokens")
        start = 0 if chunk.restored else req.num_computed_tokens
        req.num_computed_tokens += chunk.num_tokens
        if not chunk.draft:  # (a speculating chunk commits once it knows what was accepted)
            self.blocks.commit(req, start, req.num_computed_tokens)
        if req.pending_forks and req.num_computed_tokens == req.fork_at:
            self._fork(req)
        if not samples:
            return None
        if beam_cands is not None:
            if any(math.isnan(lp) or lp == math.inf for _, lp in beam_cands):
                raise ValueError("a beam candidate's logprob is not a number")
            req.candidates = [tuple(c) for c in beam_cands]
            return None
        first = req.num_output_tokens == req.num_resumed_tokens  # its first token this engine sends
        tokens, reason = [], None
        for t in (*chunk.draft[:num_accepted], token):
            req.output_token_ids.append(t)
            tokens.append(t)
            reason = req.stop_reason(self.config.max_model_len)
            if reason is not None:
                break
        if chunk.draft:
            self._settle_draft(chunk, start, num_accepted, len(tokens) - 1)
        prompt_logprobs = self._first_of_request(req) if first and req.asks_prompt_logprobs else False
        if reason is not None:
            self._finish(req, reason)
        delta = TokenDelta(req.request_id, tokens, req.num_prompt_tokens, reason, req.seq_index,
                           logprobs=token_lps[: len(tokens)] if token_lps is not None else [],
                           stop_token_id=tokens[-1] if reason == "stop" else None)
        if first:  # a sequence's first delta says what its prompt cost
            delta.num_cached_tokens = req.num_cached_tokens
            if prompt_logprobs:  # once a request: the gateway gives them to every sample
                delta.prompt_logprobs = req.prompt_logprobs
        return delta

    def _settle_draft(self, chunk: ScheduledChunk, start: int, num_accepted: int, num_kept: int) -> None:
        """After a speculating chunk: the accepted draft tokens it kept (all, unless a stop came
        first) are computed; the verified blocks are committed, the rejected slots given back."""
        req = chunk.sequence
        req.num_computed_tokens += num_kept
        self.speculator.record(len(chunk.draft), num_accepted)
        self.blocks.commit(req, start, req.num_computed_tokens)
        self.blocks.trim(req, req.num_computed_tokens)

    def _apply_pooled(self, chunk: ScheduledChunk, embedding: bytes) -> PooledOutput:
        """The last chunk of an embedding request's prompt: it ends, with its pooled vector."""
        req = chunk.sequence
        if not embedding:
            raise ValueError("the executor sent no pooled vector for an embedding request")
        start = req.num_computed_tokens  # (never restored from swap: pooling requests are recomputed)
        req.num_computed_tokens += chunk.num_tokens
        self.blocks.commit(req, start, req.num_computed_tokens)  # its prompt's blocks stay cached for others
        self._finish(req, "stop")
        return PooledOutput(req.request_id, embedding, req.num_prompt_tokens, req.num_cached_tokens)

    @staticmethod
    def expected_embeddings(chunks: list[ScheduledChunk]) -> int:
        """How many pooled vectors the result of a step of these chunks must hold."""
        return sum(1 for c in chunks if c.samples and c.sequence.params.pooling is not None)

    def _first_of_request(self, req: Sequence) -> bool:
        """Whether this is the request's first delta among its samples (counted if so)."""
        if req.params.n == 1:
            return True
        group = self.groups[req.request_id]
        first, group.first_delta_sent = not group.first_delta_sent, True
        return first

    def _advance_beams(self, request_id: str) -> list[tuple[Sequence, TokenDelta]]:
        """Once every live beam has its candidates: step the search (`beam_search.advance`),
        end the beams it dropped, and the search when it is done."""
        group = self.groups.get(request_id)
        live = group.live if group is not None and group.beam is not None else []
        if not live or any(r.candidates is None for r in live):
            return []
        first = live[0]
        continued, dropped, done = beam_search.advance(group.beam, live, self._fork_beam, self.config.max_model_len)
        for beam in dropped:
            self._finish(beam, "dropped")
        if not done:
            return []
        for beam in continued:
            self._finish(beam, "length")
        return [(first, TokenDelta(request_id, list(hyp.token_ids), first.num_prompt_tokens, hyp.finish_reason, i))
                for i, hyp in enumerate(group.beam.finished[: group.params.n])]

    def _fork_beam(self, parent: Sequence, seq_index: int) -> Sequence:
        """A second beam continuing parent: its blocks shared, its output history forked."""
        beam = parent.spawn(seq_index)
        beam.output_token_ids = parent.output_token_ids.fork()
        self.blocks.fork(parent, beam)
        if not parent.block_table:  # the parent was preempted: so is its child
            beam.num_computed_tokens = 0
        beam.status = parent.status if parent.block_table else SequenceStatus.WAITING
        if beam.status is SequenceStatus.RUNNING:
            self._add_running(beam)
        else:
            self.waiting.append(beam)
        self.groups[parent.request_id].seqs.append(beam)
        return beam

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            kv_blocks_used=self.blocks.num_used_blocks,
            num_preemptions_total=self.num_preemptions_total,
            num_steps_total=self.num_steps_total,
            kv_blocks_cached=self.blocks.num_cached_blocks,
            kv_blocks_saved_by_sharing=sum(len(r.block_table) for r in self.running) - self.blocks.num_used_blocks,
            prefix_cache_queries_total=self.blocks.prefix_cache_queries,
            prefix_cache_hits_total=self.blocks.prefix_cache_hits,
            num_swapped_out_total=self.num_swapped_out_total,
            num_swapped_in_total=self.num_swapped_in_total,
            decode_steps_total=self.decode_steps_total,
            decode_step_seconds_total=self.decode_step_seconds_total,
            decode_forward_seconds_total=self.decode_forward_seconds_total,
            lora_running=_count_by_adapter(self.running),
            lora_waiting=_count_by_adapter(self.waiting),
            max_loras=len(self.loras.slots),
            spec_decode_num_drafts_total=self.speculator.num_drafts,
            spec_decode_num_draft_tokens_total=self.speculator.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=self.speculator.num_accepted_tokens,
        )

    def record_step_time(self, chunks: list[ScheduledChunk], wall_s: float, forward_s: float) -> None:
        if chunks and all(c.num_tokens == 1 for c in chunks):
            self.decode_steps_total += 1
            self.decode_step_seconds_total += wall_s
            self.decode_forward_seconds_total += forward_s

    def check_invariants(self, at_rest: bool = False) -> None:
        """Raise AssertionError unless the queues, the pool and the swap space agree. at_rest: no
        step is in flight (every result applied), so each running sequence of a paged pool holds
        just the blocks of its computed tokens: no slot of a rejected proposal is left."""
        live = [r for group in self.groups.values() for r in group.live]
        self.blocks.check_invariants(r.block_table for r in live)
        if at_rest and isinstance(self.blocks, BlockManager):
            for r in self.running:
                assert len(r.block_table) <= self.blocks.blocks_for(r.num_computed_tokens), \
                    f"{r.request_id} holds {len(r.block_table)} blocks for {r.num_computed_tokens} computed tokens"
        for r in self.waiting:
            assert not r.block_table and (r.num_computed_tokens == 0 or r.swapped_blocks)
        if self.swap is not None:
            self.swap.check_invariants([r.swapped_blocks for r in live])
        # a swap-out whose step is not answered yet is not swapped back in
        assert not any(r.status is SequenceStatus.RUNNING for reqs in self._swap_outs.values() for r in reqs)
        if self.by_priority:
            self.waiting.check_invariants()
            assert all(rank(a) <= rank(b) for a, b in pairwise(self.running)), "running out of order"
        self.loras.check_invariants([r.params.lora for r in self.running])
        assert set(self.running) | set(self.waiting) == set(live)
        assert len(self.running) + len(self.waiting) == len(live)


def _count_by_adapter(seqs) -> dict[str, int]:
    """Requests (first sequences) under each LoRA adapter, by adapter name."""
    counts: dict[str, int] = {}
    for r in seqs:
        if r.params.lora is not None and r.seq_index == 0:
            counts[r.params.lora.name] = counts.get(r.params.lora.name, 0) + 1
    return counts
