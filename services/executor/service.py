"""The executor stage: takes ExecuteSteps from the scheduler, runs them, sends back sampled tokens.

It connects to the scheduler's two bound sockets, announces its KV pool and the step
limits it was sized for with `ExecutorReady`, then runs one step at a time, in the order
they come; a step the scheduler built before the previous one's result (async scheduling) names the tokens
that step sampled as placeholders, filled in here (`previous_tokens`). Sampling
parameters and token histories come once per request and sequence and are kept here
(`seq_states`), filled into each step on receipt. A step that raises is reported as
`StepFailed` and the executor keeps serving; a sequence whose own computation fails, or
whose state is missing, is no step failure (`StepResult.failed`, see `model_runner`). A `SchedulerHello` (a scheduler that
restarted and has no pool) is answered with the same `ExecutorReady` again.
SIGTERM/SIGINT end it after the step in flight.

With `--tensor-parallel-size N` the stage is N processes, one per `--tp-rank`, that
meet at `--tp-init-address` (see `tp_group`). Rank 0 is the executor above: only it
talks to the scheduler (and beats), and it hands every step to the other ranks before
running its share; the others (`follow`) run each step they are handed and answer
nobody. A step whose forward pass fails leaves the ranks out of step, so under tensor
parallelism it ends the rank (after rank 0 answers `StepFailed` when the failure was
its own computation; when a peer died it answers nothing, so the scheduler recomputes
the step's requests once the restarted group announces itself). A rank that dies
takes the group down with it: its peers' next collective fails, and the launcher
restarts the whole group.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

import torch
import zmq

from services.executor.model_runner import ModelRunner
from services.executor.options import ExecutorOptions
from services.executor.previous_tokens import PreviousTokens
from services.executor.seq_states import SequenceStates
from services.executor.tp_group import KEEPALIVE_S, GroupBroken, TPGroup, insecure_allowed, leave
from services.scheduler.options import SpeculativeOptions
from shared import cpu_placement
from shared.config import Addresses
from shared.curve import stage_keys
from shared.heartbeat import INSTANCE_ID, HeartbeatThread
from shared.lora_options import LoraOptions
from shared.messages import (
    ExecuteStep,
    ExecutorReady,
    ExecutorToScheduler,
    FailedRow,
    RankKeepalive,
    RankStop,
    SchedulerHello,
    SchedulerToExecutor,
    StepFailed,
    StepResult,
)
from shared.model_files import resolve_model
from shared.options import from_args, with_values
from shared.transport import PullSocket, PushSocket, configure

log = logging.getLogger("pagedserve.executor")

POLL_MS = 100  # how often the idle loop looks at the stop flag


def keep_main_core() -> None:
    """After the warm-up passes, so the OpenMP team's workers exist and move with the rest."""
    kept = cpu_placement.keep_core_for_main_thread()
    if kept is None:
        log.info("one core allowed: the main thread keeps no core to itself")
        return
    core, rest, moved = kept
    log.info("the main thread keeps core %d to itself; %d other threads (OpenMP workers, sockets) run on cores %s",
             core, moved, ",".join(map(str, sorted(rest))))


def rank_device(device: str, rank: int, size: int) -> str:
    """Rank r of a CUDA group takes the r-th GPU from the one named (cuda -> cuda:r, cuda:2 -> cuda:2+r)."""
    if size == 1 or not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


class Executor:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.executor_id = args.executor_id or f"executor-{os.getpid()}"
        self.state = "loading model"
        self.stop = threading.Event()
        self.broken: GroupBroken | None = None
        self.previous = PreviousTokens()  # the last step's tokens, for a step built ahead of its result
        self.states = SequenceStates()  # sampling and histories, sent once per request

    def run(self) -> int:
        args = self.args
        size, rank = args.tensor_parallel_size, args.tp_rank
        if size < 1 or not 0 <= rank < size:
            raise SystemExit(f"--tp-rank {rank} outside --tensor-parallel-size {size}")
        if size > 1 and not args.tp_init_address:
            raise SystemExit("--tensor-parallel-size > 1 needs --tp-init-address (or PAGEDSERVE_TP_INIT_ADDRESS)")
        if args.threads:
            torch.set_num_threads(args.threads)
        device = rank_device(args.device, rank, size)
        group = (TPGroup.join(rank, size, args.tp_init_address, torch.device(device),
                              allow_insecure=insecure_allowed(args.allow_insecure_tp_rendezvous)) if size > 1
                 else TPGroup.single())
        if rank > 0:
            code = self.follow(self.load(device, group), group)
            if code == 0:
                group.close()
            return code
        addr = Addresses.from_args(args, required=("executor_in", "executor_out"))
        ctx = configure(zmq.Context(), stage_keys(args, addr))
        heartbeat = None
        if addr.status:
            heartbeat = HeartbeatThread(ctx, addr.status, "executor", self.executor_id, lambda: self.state,
                                        engine=args.engine)
            heartbeat.start()
        steps = results = None
        try:
            runner = self.load(device, group)
            if self.stop.is_set():
                group.send(RankStop())
                group.close()
                return 0
            steps = PullSocket(ctx, addr.executor_in, SchedulerToExecutor, bind=False)
            results = PushSocket(ctx, addr.executor_out, ExecutorToScheduler, bind=False)
            if args.keep_main_core and torch.device(device).type == "cpu":
                keep_main_core()
            ready = ExecutorReady(executor_id=self.executor_id, num_kv_blocks=runner.num_kv_blocks,
                                  block_size=runner.block_size, max_model_len=runner.max_model_len,
                                  num_swap_blocks=runner.swap.num_blocks, instance=INSTANCE_ID,
                                  vocab_size=runner.vocab_size, max_num_seqs=runner.options.limits.max_num_seqs,
                                  max_num_batched_tokens=runner.options.limits.max_num_batched_tokens)
            results.send(ready)
            self.state = "ready"
            log.info("executor %s ready", self.executor_id)
            idle_since = time.monotonic()
            while not self.stop.is_set():
                step = steps.recv(timeout_ms=POLL_MS)
                if isinstance(step, SchedulerHello):
                    results.send(ready)
                elif step is not None:
                    self.states.receive(step)  # releases and new state count even if the step is refused
                    refused = self.previous.fill(step)
                    if refused is not None:
                        log.error("%s", refused)
                        self.previous.clear()
                        results.send(StepFailed(step_id=step.step_id, message=refused))
                        continue
                    group.send(step)  # as sent: the other ranks do not sample
                    failed = self.states.fill(step)
                    results.send(self.execute(runner, step, failed))
                    if self.broken is not None:
                        raise self.broken
                    idle_since = time.monotonic()
                elif group.size > 1 and time.monotonic() - idle_since >= KEEPALIVE_S:
                    group.send(RankKeepalive())
                    idle_since = time.monotonic()
            group.send(RankStop())
            group.close()
            return 0
        except GroupBroken as exc:
            log.error("%s: the tensor-parallel group is broken; exiting so that the group restarts", exc)
            return 1
        finally:
            for sock in (steps, results):
                if sock is not None:
                    sock.close()
            if heartbeat is not None:
                heartbeat.stop()
                heartbeat.join(timeout=1)

    def load(self, device: str, group: TPGroup) -> ModelRunner:
        options = with_values(from_args(ExecutorOptions, self.args), device=device)
        spec = from_args(SpeculativeOptions, self.args)
        if (spec.speculative == "draft") != (spec.draft_model is not None):
            raise SystemExit("--speculative draft needs --draft-model PATH, and --draft-model needs --speculative draft")
        draft = resolve_model(spec.draft_model) if spec.speculative == "draft" else None
        return ModelRunner(resolve_model(self.args.model), options, tp=group,
                           lora_options=from_args(LoraOptions, self.args), draft_model=draft)

    def execute(self, runner: ModelRunner, step: ExecuteStep,
                failed: list[FailedRow] = ()) -> StepResult | StepFailed:
        """The step's result, or StepFailed. A peer that died mid-step raises GroupBroken (no
        answer: the restarted group's ExecutorReady makes the scheduler recompute); a forward
        pass of this rank's own that failed under tensor parallelism is answered, and
        `self.broken` then ends the rank. The rows in failed (no state held for them) ran on
        a neutral sampling: their tokens are withheld (-1) and the reasons reported."""
        try:
            result = runner.run(step)
        except GroupBroken as exc:
            self.previous.clear()
            if exc.peer_lost:
                raise
            log.exception("step %d failed", step.step_id)
            self.broken = exc
            return StepFailed(step_id=step.step_id, message=str(exc))
        except Exception as exc:
            self.previous.clear()
            log.exception("step %d failed", step.step_id)
            return StepFailed(step_id=step.step_id, message=f"{type(exc).__name__}: {exc}")
        for row in failed:
            log.error("step %d row %d: %s", step.step_id, row.index, row.message)
            result.sampled[row.index] = -1
        if failed:
            result.failed = [*result.failed, *failed]
        self.previous.record(step, result)
        return result

    def follow(self, runner: ModelRunner, group: TPGroup) -> int:
        """Ranks > 0: run every step rank 0 hands over, until it stops (0) or the group breaks (1)."""
        self.state = "ready"
        log.info("tensor-parallel rank %d of %d ready", group.rank, group.size)
        try:
            while not self.stop.is_set():
                msg = group.recv()
                if isinstance(msg, RankStop):
                    return 0
                if isinstance(msg, ExecuteStep):
                    try:
                        runner.run(msg)
                    except GroupBroken:
                        raise
                    except Exception:  # outside the forward pass (InvalidStep, a bad block move): rank 0 fails alike
                        log.exception("step %d failed (rank 0 reports it)", msg.step_id)
        except GroupBroken as exc:
            log.error("%s: exiting so that the group restarts", exc)
            return 1
        return 0


def run(args: argparse.Namespace) -> int:
    executor = Executor(args)

    def on_signal(signum, _frame):
        log.info("signal %d: stopping after the current step", signum)
        executor.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = executor.run()
    if args.tensor_parallel_size > 1:
        leave(code)
    return code
