"""The executor stage: takes ExecuteSteps from the scheduler, runs them, sends back sampled tokens.

It connects to the scheduler's two bound sockets, announces its KV pool with
`ExecutorReady`, then runs one step at a time, in the order they come; a step the
scheduler built before the previous one's result (async scheduling) names the tokens
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

from services.executor.kv_cache import parse_size
from services.executor.model_runner import ModelRunner
from services.executor.previous_tokens import PreviousTokens
from services.executor.seq_states import SequenceStates
from services.executor.tp_group import (
    INSECURE_ENV,
    INSECURE_FLAG,
    KEEPALIVE_S,
    GroupBroken,
    TPGroup,
    insecure_allowed,
)
from shared import cpu_placement
from shared.config import Addresses, add_address_args, add_log_args, add_model_args
from shared.curve import stage_keys
from shared.heartbeat import INSTANCE_ID, HeartbeatThread
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
from shared.transport import PullSocket, PushSocket, configure

log = logging.getLogger("pagedserve.executor")

POLL_MS = 100  # how often the idle loop looks at the stop flag


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="auto: bfloat16 on CUDA and on CPUs with bfloat16 matrix instructions, else float32")
    parser.add_argument("--quantization", default="auto", choices=["auto", "int4", "none"],
                        help="int4: also keep 4-bit copies of the decoder's weights (groups of 32, as GGUF Q4_1) "
                             "for steps of few tokens, where reading weights dominates; auto: int4 when the "
                             "checkpoint is already 4-bit (lossless), else none")
    parser.add_argument("--int4-max-rows", type=int, default=None,
                        help="steps of at most this many tokens use the int4 copies (default: measured at load)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="auto: the compute dtype; bfloat16 with float32 compute halves the pool's bytes per "
                             "block (CPU backends only)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="pool size; wins over --kv-cache-memory")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="bytes for the KV pool (e.g. 1073741824 or 2GiB); default 1 GiB")
    parser.add_argument("--swap-space", type=parse_size, default=0,
                        help="bytes of host memory for the KV of swapped-out sequences (--preemption-mode swap)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--executor-id", default=None, help="name in heartbeats and ExecutorReady")
    parser.add_argument("--engine", default="engine-0", help="the engine this executor serves (data parallelism)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--keep-main-core", action="store_true",
                        help="on the CPU, once loaded: the main thread keeps the first allowed core to itself, the "
                             "other threads (OpenMP workers, sockets) run on the rest (shared.cpu_placement; "
                             "`serve` passes it when one executor has the host's CPU)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "triton", "torch"],
                        help="auto: Triton kernels on CUDA, the C++ CPU kernels on the CPU (the torch reference if they cannot be built)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on CUDA, the fraction of GPU memory the executor may use; the KV pool gets what "
                             "a profiling pass of the largest batch leaves (unless sized explicitly)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens of the largest step the scheduler sends (sizes the profiling pass)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="sequences of the largest step (profiling pass, largest CUDA graph)")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="run decode steps eagerly instead of replaying CUDA graphs")
    parser.add_argument("--compile", dest="compile_decode", action="store_true",
                        help="on the CPU, run decode steps through torch.compile (inductor), one graph per bucketed "
                             "batch size compiled on its first step and cached on disk (services.executor."
                             "compiled_decode); prefill stays eager")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks this executor's model is split over (one process each, started with --tp-rank)")
    parser.add_argument("--tp-rank", type=int, default=0, help="this process's rank in the tensor-parallel group")
    parser.add_argument("--tp-init-address", default=os.environ.get("PAGEDSERVE_TP_INIT_ADDRESS"),
                        help="tcp://host:port where the ranks meet (rank 0 listens there); loopback only unless "
                             f"{INSECURE_FLAG}")
    parser.add_argument(INSECURE_FLAG, action="store_true",
                        help="let the ranks meet on a non-loopback address: torch.distributed and gloo are "
                             f"unauthenticated plaintext (or ${INSECURE_ENV}=1); only on a network no one else reaches")
    add_address_args(parser, required=False)
    add_log_args(parser)


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
                                  vocab_size=runner.vocab_size)
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
        args = self.args
        return ModelRunner(
            resolve_model(args.model), dtype=args.dtype, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
            device=device, attention_backend=args.attention_backend,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            cuda_graphs=args.cuda_graphs, swap_space=args.swap_space or 0,
            quantization=args.quantization, int4_max_rows=args.int4_max_rows,
            kv_cache_dtype=args.kv_cache_dtype, tp=group, compile_decode=args.compile_decode,
        )

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
    return executor.run()
