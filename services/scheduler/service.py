"""Scheduler stage: the socket loop around `Scheduler` and `BlockManager`.

Requests arrive from gateways over a ROUTER socket (each gateway's DEALER, identity
"gateway-<instance>", carries its requests, aborts and stops in order, and its
GatewayBeats), and each step's tokens go straight back to the gateway that sent the
request, one StepDeltas frame per gateway per step; one step at a time goes to the executor and its sampled
tokens come back. With async scheduling (the default) the step after is built and
sent while the executor runs one (`Scheduler.schedule_ahead`), so it starts the next
step as soon as it is done instead of waiting for a round trip; at most two steps
are in flight, and results apply in the order the steps were sent. The pool's size
comes from the executor's `ExecutorReady`, and so do the step limits the executor was
sized for: steps stay within them where they are below this stage's --max-num-seqs or
--max-num-batched-tokens (`options.fit_to_executor`, with a warning); a second `ExecutorReady` from a new
executor instance means the executor restarted and lost the KV cache, so every
running request is preempted and recomputed. One that comes back with another pool
(fewer or more blocks, another block size or swap space, a shorter context) gets a
new block manager sized for it: the requests recompute there, and those it can never
hold end with a 503. An executor reporting an unusable pool (no blocks) is refused
until it reports a usable one. A failed step's swap-outs are not taken as done: those
sequences recompute (`Scheduler.undo_swaps`). After any restart or a step left unanswered,
every sequence's sampling state is sent to the executor again (`ExecutorStates.reset`). A scheduler that has no pool yet says
`SchedulerHello` every HELLO_INTERVAL_S, so an executor that outlived the previous
scheduler announces itself again.

A request whose own handling raises fails alone: it gets a RequestError 500, its
blocks are freed and the loop goes on (see `Scheduler.take_failed`); so does one whose
row of a step the executor failed alone (`StepResult.failed`: 400 when its own
constraints leave no token, else 500), while the step's other rows apply. Replies to a
gateway whose queue is full wait in an `Outbox` and hold that gateway's requests; a
gateway stuck past STALL_TIMEOUT_S has its requests failed (503) and freed. A gateway
silent (no beat, nothing) for GATEWAY_LOST_AFTER_S is lost (`gateway_watch`): its
requests are aborted and freed, with no reply. Nor does an abort from a gateway get one:
the gateway ends that stream itself. Since a request and its abort come on one pipe in
order, an abort for a request the scheduler does not know is for one that ended already.

A TokenizedRequest with output_token_ids resumes a request another engine was running:
it is admitted with that output (`Sequence.num_resumed_tokens`) and generates on after it.

With --kv-events-endpoint the prefix cache's changes go out as KV cache events in vLLM's wire
format (`shared.kv_events`) on a PUB socket (`shared.transport.KVEventPublisher`): every block
manager this stage builds records them into one list, drained into one `KVEventBatch` per
loop pass that changed the cache (a step's admissions, evictions and committed blocks), which
carries this engine's data-parallel rank; engine i publishes on the endpoint's port + i.
A pool rebuilt for a new executor starts with `AllBlocksCleared` (the old pool's reset).
Only the paged block manager has a prefix cache: the reservation baselines publish nothing.

While a dashboard watches (a `WatchPool` subscription, renewed by the gateway), a
`PoolSnapshot` goes to the gateway on the status channel every interval; none is built
or sent otherwise.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from services.scheduler.block_manager import BlockManager
from services.scheduler.gateway_watch import GATEWAY_LOST_AFTER_S, GatewayWatch
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.kv_accounting import kv_usage
from services.scheduler.options import (
    WARMUP_FACTOR,
    KVEventsOptions,
    SpeculativeOptions,
    engine_rank,
    fit_to_executor,
    speculative_config,
)
from services.scheduler.outbox import Outbox
from services.scheduler.pool_snapshot import pool_snapshot
from services.scheduler.pool_watch import PoolWatch
from services.scheduler.reservation import make_allocator
from services.scheduler.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared import cpu_placement
from shared.config import Addresses, BatchLimits
from shared.curve import stage_keys
from shared.heartbeat import INSTANCE_ID, HeartbeatThread
from shared.kv_events import KVEventBatch, offset_endpoint
from shared.messages import (
    AbortRequest,
    ExecuteStep,
    ExecutorReady,
    ExecutorToScheduler,
    FinishRequest,
    GatewayBeat,
    GatewayToScheduler,
    RequestError,
    SchedulerHello,
    SchedulerStats,
    SchedulerToExecutor,
    SchedulerToGateway,
    StatusToGateway,
    StepDeltas,
    StepFailed,
    StepResult,
    TokenDelta,
    TokenizedRequest,
    WatchPool,
)
from shared.options import from_args
from shared.transport import KVEventPublisher, PullSocket, PushSocket, RouterSocket, configure, wait_readable

log = logging.getLogger("pagedserve.scheduler")

HELLO_INTERVAL_S = 0.5
STATS_INTERVAL_S = 0.05  # heartbeats go out every 0.25 s: fresher stats would go unseen
STALL_TIMEOUT_S = 30.0  # a gateway that reads nothing for this long loses its requests
BACKLOG_POLL_MS = 5  # how soon a gateway's backlog is retried
# The step after the one in flight is built --ahead-fraction of the last step's time into it (at
# most AHEAD_MAX_DELAY_S), not as soon as that one starts: see `_ahead_due`.
AHEAD_MAX_DELAY_S = 0.03
AHEAD_MIN_STEP_S = 0.01  # steps shorter than this get theirs at once
PROMPT_AVERAGE_WEIGHT = 0.25  # each new prompt's weight in the running average of prompt lengths


@dataclass(frozen=True)
class StepInFlight:
    step_id: int
    chunks: list[ScheduledChunk]
    started: float  # when it was built, or the result before it came (perf_counter)


def scheduler_name(engine: str) -> str:
    """The scheduler's replica name in heartbeats: "scheduler" for the first engine."""
    return "scheduler" if engine == "engine-0" else f"scheduler-{engine.removeprefix('engine-')}"


class SchedulerService:
    def __init__(self, args: argparse.Namespace, ctx: zmq.Context):
        addr = Addresses.from_args(args)
        self.args = args
        self.requests_in = RouterSocket(ctx, addr.scheduler_in, GatewayToScheduler, SchedulerToGateway, bind=True)
        self.steps_out = PushSocket(ctx, addr.executor_in, SchedulerToExecutor, bind=True)
        self.results_in = PullSocket(ctx, addr.executor_out, ExecutorToScheduler, bind=True)
        self.scheduler: Scheduler | None = None
        self.stats: SchedulerStats | None = None
        self.stats_at = 0.0
        self.executor_id: str | None = None
        self.executor_instance: str | None = None
        self.pool_reported: tuple | None = None  # (blocks, block size, swap blocks, config) the pool is built for
        self.hello_at = 0.0
        # steps sent and not answered, oldest first: two while one is built ahead of the other's result
        self.in_flight: deque[StepInFlight] = deque()
        self.result_at: float | None = None  # when the last step's result came, while work kept waiting
        self.last_step_s: float | None = None  # how long the executor took for the last step answered
        self.prompt_average = 0.0  # prompt tokens of the requests received, a running average
        self.executor_lost: str | None = None  # why, while the executor does not answer
        self.executor_warm = False  # it answered a step since it announced itself
        self.pending: list[tuple[bytes, TokenizedRequest]] = []  # before the executor is up
        self.heartbeat = HeartbeatThread(
            ctx, addr.status, "scheduler", scheduler_name(args.engine), self._state,
            lambda: self.stats, engine=args.engine,
        )
        self.outbox = Outbox(self.requests_in, STALL_TIMEOUT_S)
        self.gateways = GatewayWatch(GATEWAY_LOST_AFTER_S)
        self.replies: dict[bytes, list] = {}  # to each gateway, sent once the next step is out
        self.watch = PoolWatch()
        # a gateway that stops reading leaves at most one subscription's snapshots (ttl / interval) queued
        self.snapshots_out = PushSocket(ctx, addr.status, StatusToGateway)
        self.kv_events, self.kv_rank = kv_event_publisher(ctx, from_args(KVEventsOptions, args), args.engine)
        self.kv_pending: list = []  # events the block managers recorded since the last batch
        try:
            self.speculative = speculative_config(from_args(SpeculativeOptions, args))
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        self.running = True

    def refresh_stats(self) -> None:
        """Snapshot for the heartbeat thread, which must not read the scheduler mid-change."""
        self.stats_at = time.monotonic()
        stats = self.scheduler.stats()
        usage = kv_usage(self.scheduler)
        self.stats = msgspec.structs.replace(
            stats, kv_slots_token_states=int(usage.token_states), kv_slots_reserved=int(usage.reserved),
            kv_slots_internal_frag=int(usage.internal_frag), kv_slots_external_frag=int(usage.external_frag))

    def send_snapshot(self) -> None:
        snapshot = pool_snapshot(self.scheduler, scheduler_name(self.args.engine), INSTANCE_ID, self.args.kv_policy)
        self.snapshots_out.send_nowait(snapshot)

    def _state(self) -> str:
        if self.executor_lost is not None:
            return f"executor lost: {self.executor_lost}"
        return "ready" if self.scheduler else "waiting for executor"

    # --- messages from the executor --------------------------------------------------

    def _pool(self, msg: ExecutorReady):
        """The config, block manager and swap space for the pool an executor reports."""
        if msg.num_kv_blocks < 1 or msg.block_size < 1 or msg.num_swap_blocks < 0 or msg.max_model_len < 1:
            raise ValueError(f"{msg.num_kv_blocks} blocks of {msg.block_size} tokens, {msg.num_swap_blocks} swap "
                             f"blocks, a context of {msg.max_model_len}")
        max_len = min(msg.max_model_len, self.args.max_model_len or msg.max_model_len)
        limits = fit_to_executor(from_args(BatchLimits, self.args), msg)
        config = SchedulerConfig(limits.max_num_seqs, limits.max_num_batched_tokens, max_len,
                                 self.args.preemption_mode, msg.vocab_size,
                                 scheduling_policy=self.args.scheduling_policy,
                                 max_loras=getattr(self.args, "max_loras", 4),
                                 speculative=self.speculative)
        if config.preemption_mode == "swap" and not msg.num_swap_blocks:
            log.warning("--preemption-mode swap without executor swap space: preempted requests recompute")
        blocks = make_allocator(self.args.kv_policy, msg.num_kv_blocks, msg.block_size, max_len,
                                self.args.prefix_caching)
        if self.kv_events is not None and isinstance(blocks, BlockManager):
            blocks.events = self.kv_pending
        return config, blocks, HostBlockPool(msg.num_swap_blocks)

    def on_executor_ready(self, msg: ExecutorReady) -> None:
        if msg.instance and msg.instance == self.executor_instance and self.executor_lost is None:
            return  # the executor we know, answering a hello: its KV is intact
        try:
            config, blocks, swap = self._pool(msg)
        except ValueError as exc:
            log.error("executor %s refused: it reports an unusable pool (%s)", msg.executor_id, exc)
            if self.scheduler is not None and self.executor_lost is None:
                self.executor_lost = f"executor {msg.executor_id} reports an unusable pool"
                self.scheduler.preempt_all()
                self.in_flight.clear()
            return
        if self.executor_lost is not None:
            log.warning("executor answers again after %s", self.executor_lost)
        self.executor_lost, self.executor_warm = None, False
        self.executor_instance = msg.instance
        if self.scheduler is None:
            self.scheduler = Scheduler(config, blocks, swap)
            log.info("executor %s ready: %d blocks of %d tokens", msg.executor_id, msg.num_kv_blocks, msg.block_size)
            log.info("%s", config.speculative.describe())
            for peer, req in self.pending:
                self.on_request(peer, req)
            self.pending.clear()
        else:
            old = self.scheduler
            log.warning("executor %s (re)started: recomputing %d running requests", msg.executor_id,
                        len(old.running))
            if (msg.num_kv_blocks, msg.block_size, msg.num_swap_blocks, config) != self.pool_reported:
                log.warning("it reports another pool: %d blocks of %d tokens, %d swap blocks, a context of %d "
                            "(was %s); rebuilding the block manager", msg.num_kv_blocks, msg.block_size,
                            msg.num_swap_blocks, config.max_model_len, self.pool_reported[:3])
                for req, problem in old.replace_pool(blocks, swap, config):
                    self._reply(req.reply_to, RequestError(
                        req.request_id, 503, f"the executor restarted with a smaller pool or context: {problem}",
                        "service_unavailable"))
            else:
                old.preempt_all()
            self.in_flight.clear()
        self.pool_reported = (msg.num_kv_blocks, msg.block_size, msg.num_swap_blocks, config)
        self.executor_id = msg.executor_id

    def on_step_done(self, msg: StepResult | StepFailed) -> None:
        if not self.in_flight or msg.step_id != self.in_flight[0].step_id:
            return  # a step from before an executor restart
        step = self.in_flight.popleft()
        chunks = step.chunks
        started = self._began(step)
        self.result_at = time.perf_counter()
        self.last_step_s = self.result_at - started
        self.executor_warm = True
        drafts = self.scheduler.expected_drafts(chunks)
        accepted = msg.num_accepted if isinstance(msg, StepResult) else []
        beams, logprobs, scored = self.scheduler.expected_outputs(chunks, accepted)
        if isinstance(msg, StepResult) and (len(msg.sampled) != len(chunks) or len(msg.top_logprobs) != beams
                                            or len(accepted) != len(drafts)
                                            or len(msg.proposed) != self.scheduler.expected_proposals(chunks)
                                            or any(not 0 <= a <= d for a, d in zip(accepted, drafts, strict=False))
                                            or len(msg.logprobs) != logprobs or len(msg.prompt_logprobs) != scored
                                            or any(not 0 <= f.index < len(chunks) for f in msg.failed)
                                            or len(msg.embeddings) != self.scheduler.expected_embeddings(chunks)):
            msg = StepFailed(msg.step_id, f"result for {len(msg.sampled)} sequences, step had {len(chunks)}")
        if isinstance(msg, StepFailed):
            log.error("step %d failed: %s", msg.step_id, msg.message)
            self.scheduler.undo_swaps(msg.step_id)
            for chunk in chunks:
                req = self.scheduler.finish_request(chunk.sequence.request_id, "error")
                if req is not None:
                    self._reply(req.reply_to, RequestError(req.request_id, 500, f"model execution failed: {msg.message}", "internal_error"))
            return
        self.scheduler.confirm_swaps(msg.step_id)
        for req, row in self.scheduler.fail_rows(chunks, msg.failed):  # one row's failure ends its request only
            status = 400 if 400 <= row.status < 500 else 500
            self._reply(req.reply_to, RequestError(req.request_id, status, row.message,
                                                   "invalid_request_error" if status == 400 else "internal_error"))
        for req, delta in self.scheduler.process_results(chunks, msg.sampled, msg.top_logprobs, msg.logprobs,
                                                             msg.prompt_logprobs, msg.embeddings, msg.num_accepted,
                                                             msg.proposed):
            self._reply(req.reply_to, delta)
        self._report_failures()
        # from the previous result (or from scheduling, after idling) to this one: the whole
        # cycle, so the time outside the forward pass includes handling results and scheduling
        self.scheduler.record_step_time(chunks, self.result_at - started, msg.forward_s)

    def _report_failures(self) -> None:
        for req in self.scheduler.take_failed():
            self._reply(req.reply_to, RequestError(req.request_id, 500, "internal error while serving this request",
                                                   "internal_error"))

    def _fail(self, request_id: str, peer: bytes, exc: Exception) -> None:
        """A message about one request raised: that request fails, nothing else."""
        if self.scheduler is not None and request_id in self.scheduler.groups:
            self.scheduler.fail_request(request_id, exc)
            self._report_failures()
        else:
            log.error("message for request %s failed: %r", request_id, exc, exc_info=exc)
            self._reply(peer, RequestError(request_id, 500, "internal error while serving this request",
                                           "internal_error"))

    # --- messages from gateways -------------------------------------------------------

    def on_request(self, peer: bytes, msg: TokenizedRequest) -> None:
        if self.scheduler is None:
            self.pending.append((peer, msg))
            return
        req = Sequence(msg.request_id, list(msg.prompt_token_ids), msg.params, frozenset(msg.eos_token_ids),
                       msg.arrival_time, reply_to=peer, compiled_grammar=msg.compiled_grammar,
                       output_token_ids=list(msg.output_token_ids), num_resumed_tokens=len(msg.output_token_ids),
                       priority=msg.priority)
        problem = self.scheduler.check_fits(req)
        if problem is None and msg.request_id in self.scheduler.groups:
            problem = f"request id {msg.request_id!r} is already in use"
        if problem is not None:
            self._reply(peer, RequestError(msg.request_id, 400, problem))
            return
        self.scheduler.add_request(req)
        self._note_prompt(len(msg.prompt_token_ids))

    def _note_prompt(self, tokens: int) -> None:
        self.prompt_average += PROMPT_AVERAGE_WEIGHT * (tokens - self.prompt_average)

    def on_end(self, msg: AbortRequest | FinishRequest) -> None:
        """End a request (or one sample): no reply, the gateway that sent it ends the stream
        itself. A request still pending (no executor yet) is dropped."""
        if self.scheduler is None:
            self.pending = [(p, r) for p, r in self.pending if r.request_id != msg.request_id]
            return
        reason = "abort" if isinstance(msg, AbortRequest) else msg.reason
        seq_index = msg.seq_index if isinstance(msg, FinishRequest) else None
        self.scheduler.finish_request(msg.request_id, reason, seq_index)

    def _abort_lost_gateways(self) -> None:
        """The requests of gateways silent past GATEWAY_LOST_AFTER_S end ("abort", blocks
        freed, no reply): nobody reads them."""
        for peer in self.gateways.expired():
            owned = [rid for rid, group in self.scheduler.groups.items() if group.reply_to == peer] \
                if self.scheduler is not None else []
            pending = sum(1 for p, _ in self.pending if p == peer)
            if not owned and not pending:
                continue
            log.warning("gateway %r silent for over %.0f s: aborting its %d requests", peer,
                        self.gateways.lost_after_s, len(owned) + pending)
            for rid in owned:
                self.scheduler.finish_request(rid, "abort")
            self.pending = [(p, r) for p, r in self.pending if p != peer]
            self.outbox.drop(peer)
            self.replies.pop(peer, None)

    def _reply(self, peer: bytes, msg) -> None:
        """Queued until `_flush_replies`, which runs once the next step is on its way: the
        executor does not wait for the replies of the step before."""
        self.replies.setdefault(peer, []).append(msg)

    def _send_replies(self) -> None:
        """The queued replies, in order; each run of TokenDeltas to a gateway as one StepDeltas."""
        for peer, msgs in self.replies.items():
            run: list[TokenDelta] = []
            for msg in [*msgs, None]:
                if isinstance(msg, TokenDelta):
                    run.append(msg)
                    continue
                if run:
                    self.outbox.send(peer, run[0] if len(run) == 1 else StepDeltas(run))
                    run = []
                if msg is not None:
                    self.outbox.send(peer, msg)
        self.replies.clear()

    def _flush_replies(self) -> None:
        """Send the queued replies, retry backlogs; hold the requests of gateways that have one;
        fail the stuck."""
        self._send_replies()
        self.outbox.flush()
        if self.scheduler is None:
            return
        self.scheduler.held = self.outbox.held
        for peer in self.outbox.stalled():
            owned = [rid for rid, group in self.scheduler.groups.items() if group.reply_to == peer]
            log.error("gateway %r has read nothing for %.0f s (%d replies waiting): failing its %d requests",
                      peer, STALL_TIMEOUT_S, self.outbox.backlog(peer), len(owned))
            for rid in owned:
                self.scheduler.finish_request(rid, "error")
                self._reply(peer, RequestError(rid, 503, "the gateway serving this request stopped reading; "
                                                         "the request was ended", "service_unavailable"))
        self._send_replies()

    def _check_step_deadline(self) -> None:
        """An executor that does not answer the step in flight in time is lost, as if it
        had died: every running request is preempted, and recomputed once it answers a
        SchedulerHello (the same instance, thawed) or announces itself (a new one)."""
        if not self.in_flight:
            return
        step_id, started = self.in_flight[0].step_id, self.in_flight[0].started
        waited = time.perf_counter() - started
        if waited <= self.args.step_timeout * (1 if self.executor_warm else WARMUP_FACTOR):
            return
        self.executor_lost = f"step {step_id} unanswered for {waited:.0f} s"
        log.error("executor lost: %s; preempting %d running requests until it answers again", self.executor_lost,
                  len(self.scheduler.running))
        self.scheduler.preempt_all()
        self.in_flight.clear()
        self.hello_at = 0.0

    def publish_kv_events(self) -> None:
        """The cache's changes since the last batch as one KVEventBatch; replay requests answered."""
        if self.kv_events is None:
            return
        if self.kv_pending:
            self.kv_events.publish(KVEventBatch(time.time(), list(self.kv_pending), self.kv_rank))
            self.kv_pending.clear()
        self.kv_events.serve_replay()

    # --- the loop ---------------------------------------------------------------------

    def _send_step(self, step: ExecuteStep, chunks: list[ScheduledChunk], started: float) -> None:
        self.steps_out.send(step)
        self.in_flight.append(StepInFlight(step.step_id, chunks, started))

    def _began(self, step: StepInFlight) -> float:
        """When the executor began `step`: a step sent ahead, when it was done with the one before."""
        return step.started if self.result_at is None else max(step.started, self.result_at)

    def _ahead_due(self) -> float | None:
        """When to build the step after the one in flight (perf_counter), or None when none is to be
        built now (not one step in flight, no async scheduling, no executor).

        Built late in the step in flight, not as it starts, the next step takes in what arrived
        meanwhile: a user whose request finished comes back with its next prompt ~20 ms after its
        last token, during the next step. Built at once, the step after was already sent without
        that prompt, so it started a step later, and a running sequence finishing in that step
        queued behind it: in a closed loop of 8 users with 1.5-2K-token prompts, each prompt then
        waited for two others' prefill instead of one (TTFT p50 3.1-3.4 s against 2.2 s with no
        step built ahead). `--ahead-fraction` of the last step's time leaves the building itself time
        to finish before the step in flight does; a step that ends sooner is followed by one
        built after its result, as without async scheduling.

        Only while prompts are long (`_prompts_long`): short prompts share a step, so one that
        misses a step waits one decode step, not another's prefill, and there the late build cost
        throughput (0.8 with prompts under 160 tokens: 0.87-0.97x the tok/s at 16 and 64 users,
        `benchmarks.placement`, variants default and ahead-late)."""
        if len(self.in_flight) != 1 or not self.args.async_scheduling or self.executor_lost is not None:
            return None
        began = self._began(self.in_flight[0])
        last = self.last_step_s
        if last is None or last < AHEAD_MIN_STEP_S or not self._prompts_long():
            return began
        return began + min(self.args.ahead_fraction * last, AHEAD_MAX_DELAY_S)

    def _prompts_long(self) -> bool:
        """Whether the recent prompts average at least --ahead-long-prompts of a step's token budget:
        prompts that cannot share a step with another."""
        if self.scheduler is None:
            return False
        share = self.args.ahead_long_prompts
        return self.prompt_average >= share * self.scheduler.config.max_num_batched_tokens

    def serve(self) -> None:
        self.heartbeat.start()
        stalled = False  # work is queued but nothing fits until something changes
        while self.running:
            self._check_step_deadline()
            lost = self.scheduler is None or self.executor_lost is not None
            if lost and time.monotonic() - self.hello_at > HELLO_INTERVAL_S:
                self.steps_out.send_nowait(SchedulerHello(INSTANCE_ID))
                self.hello_at = time.monotonic()
            can_step = not self.in_flight and not lost and self.scheduler.has_work
            idle_ms = BACKLOG_POLL_MS if self.outbox.held else 100
            if self.watch.active:
                idle_ms = min(idle_ms, int(self.watch.interval_s * 1000))
            timeout_ms = 0 if can_step and not stalled else idle_ms
            due = self._ahead_due()
            if due is not None and due > time.perf_counter():  # (past it, messages wake the loop as before)
                timeout_ms = min(timeout_ms, math.ceil((due - time.perf_counter()) * 1000))
            ready = wait_readable([self.requests_in, self.results_in], timeout_ms)
            stalled = stalled and not ready
            if self.requests_in in ready:
                received = self.requests_in.recv_nowait()
                self.gateways.heard(peer for peer, _ in received)
                for peer, msg in received:
                    if isinstance(msg, GatewayBeat):
                        continue  # heard: that is all a beat says
                    try:
                        if isinstance(msg, TokenizedRequest):
                            self.on_request(peer, msg)
                        elif isinstance(msg, WatchPool):
                            self.watch.renew(msg)
                        else:
                            self.on_end(msg)
                    except Exception as exc:
                        if isinstance(msg, WatchPool):
                            log.exception("dashboard subscription failed")
                        else:
                            self._fail(msg.request_id, peer, exc)
            if self.gateways.due():
                self._abort_lost_gateways()
            if self.results_in in ready:
                for msg in self.results_in.recv_nowait():
                    if isinstance(msg, ExecutorReady):
                        self.on_executor_ready(msg)
                    else:
                        self.on_step_done(msg)
            if not self.in_flight and not (self.scheduler and self.scheduler.has_work):
                self.result_at = None  # idle: the wait for new work is not step time
            if not self.in_flight and self.scheduler and self.executor_lost is None and self.scheduler.has_work:
                started = time.perf_counter() if self.result_at is None else self.result_at
                scheduled = self.scheduler.schedule()
                self._report_failures()
                stalled = scheduled is None
                if scheduled is not None:
                    self._send_step(*scheduled, started)
            due = self._ahead_due()
            if due is not None and time.perf_counter() >= due:
                ahead = self.scheduler.schedule_ahead(self.in_flight[0].chunks)
                self._report_failures()
                if ahead is not None:
                    self._send_step(*ahead, time.perf_counter())
            self._flush_replies()  # after the next step left: the executor is not kept waiting for them
            self.publish_kv_events()
            if self.scheduler is not None and time.monotonic() - self.stats_at >= STATS_INTERVAL_S:
                self.refresh_stats()
            if self.scheduler is not None and self.watch.due():
                try:
                    self.send_snapshot()
                except Exception:  # a dashboard must never take the scheduler down
                    log.exception("pool snapshot failed")
        self._send_replies()
        self.heartbeat.stop()
        self.snapshots_out.close()
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.close()


def kv_event_publisher(ctx: zmq.Context, options: KVEventsOptions, engine: str) -> tuple[KVEventPublisher | None, int]:
    """The KV events publisher of engine `engine` (None without --kv-events-endpoint), and its rank."""
    if not options.kv_events_endpoint:
        return None, 0
    rank = engine_rank(engine)
    endpoint = offset_endpoint(options.kv_events_endpoint, rank)
    replay = offset_endpoint(options.kv_events_replay_endpoint, rank)
    publisher = KVEventPublisher(ctx, endpoint, replay_endpoint=replay, topic=options.kv_events_topic,
                                 connect=options.kv_events_connect, allow_network=options.kv_events_allow_network)
    log.info("publishing KV cache events on %s%s (data-parallel rank %d)", endpoint,
             f", replay on {replay}" if replay else "", rank)
    return publisher, rank


def run(args: argparse.Namespace) -> int:
    ctx = configure(zmq.Context(), stage_keys(args, Addresses.from_args(args)))
    service = SchedulerService(args, ctx)

    def stop(*_):
        service.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    cpu_placement.settle()
    log.info("scheduler up (pid %d) at %s", os.getpid(), args.scheduler_in)
    t0 = time.time()
    service.serve()
    log.info("scheduler stopped after %.0f s", time.time() - t0)
    return 0
