"""`pagedserve serve`: start every stage as its own OS process and keep them alive.

Each stage runs as `python -m services.cli stage NAME ...`, so `ps` names it. They
talk over ipc:// sockets in a private run directory unless tcp:// addresses are
given. A stage that dies is restarted (the others reconnect on their own); a stage
that keeps dying at start-up stops the whole server. SIGINT/SIGTERM stop the stages in
order: the gateway first, which drains (finishes the requests in flight, up to
--shutdown-timeout), then the others, which the drain still needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.gateway.options import API_KEY_ENV, add_exposure_args, exposure_argv
from shared.config import Addresses, add_address_args, add_log_args, add_model_args, default_run_dir
from shared.model_files import default_served_name, resolve_model

log = logging.getLogger("pagedserve.launcher")

CRASH_LOOP_RESTARTS = 5  # restarts within CRASH_LOOP_WINDOW_S that mean "give up"
CRASH_LOOP_WINDOW_S = 60.0
STOP_TIMEOUT_S = 10.0  # for each stage but the draining gateway


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="bytes for the KV pool (e.g. 2GiB)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    parser.add_argument("--swap-space", default=None, help="bytes of host memory for swapped KV (e.g. 4GiB)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--kv-policy", default="paged",
                        choices=["paged", "reserve-max", "reserve-pow2", "reserve-oracle"])
    parser.add_argument("--tokenizer-replicas", type=int, default=1)
    parser.add_argument("--executor-threads", type=int, default=None, help="torch threads in the executor")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on CUDA, the fraction of GPU memory the executor may use (KV pool sizing)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="no CUDA graphs for decode steps")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    add_exposure_args(parser)
    add_address_args(parser, required=False)
    add_log_args(parser)


def stage_commands(args: argparse.Namespace, addresses: Addresses) -> dict[str, list[str]]:
    """The command line of every stage process, by a unique stage name."""
    base = [sys.executable, "-m", "services.cli", "stage"]
    common = addresses.as_argv() + ["--log-level", args.log_level]
    model = ["--model", args.model]
    served = default_served_name(args.model) if args.served_model_name is None else args.served_model_name

    executor = model + ["--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size)]
    if args.num_kv_blocks is not None:
        executor += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.kv_cache_memory is not None:
        executor += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.executor_threads is not None:
        executor += ["--threads", str(args.executor_threads)]
    executor += ["--attention-backend", args.attention_backend,
                 "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                 "--max-num-seqs", str(args.max_num_seqs),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if not args.cuda_graphs:
        executor += ["--no-cuda-graphs"]
    if args.swap_space is not None:
        executor += ["--swap-space", str(args.swap_space)]
    scheduler = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.max_model_len is not None:
        scheduler += ["--max-model-len", str(args.max_model_len)]
    scheduler += ["--preemption-mode", args.preemption_mode, "--kv-policy", args.kv_policy]
    scheduler += [] if args.prefix_caching else ["--no-prefix-caching"]
    gateway = model + ["--host", args.host, "--port", str(args.port), "--served-model-name", served,
                       "--request-timeout", str(args.request_timeout)] + exposure_argv(args)

    cmds = {
        "scheduler": base + ["scheduler"] + scheduler + common,
        "executor": base + ["executor"] + executor + common,
        "gateway": base + ["gateway"] + gateway + common,
    }
    tokenizer = model + (["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])
    for i in range(args.tokenizer_replicas):
        cmds[f"tokenizer-{i}"] = base + ["tokenizer", "--replica", f"tokenizer-{i}"] + tokenizer + common
    return cmds


@dataclass
class Stage:
    name: str
    cmd: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, start_new_session=False, env=self.env)
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def crash_looping(self) -> bool:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < CRASH_LOOP_WINDOW_S]
        return len(self.restarts) >= CRASH_LOOP_RESTARTS


class Supervisor:
    def __init__(self, commands: dict[str, list[str]], envs: dict[str, dict[str, str]] | None = None,
                 drain_timeout_s: float = 0.0):
        envs = envs or {}
        self.stages = [Stage(name, cmd, envs.get(name)) for name, cmd in commands.items()]
        self.drain_timeout_s = drain_timeout_s
        self.stopping = False

    def run(self) -> int:
        for stage in self.stages:
            stage.start()
        status = 0
        while not self.stopping:
            time.sleep(0.2)
            for stage in self.stages:
                code = stage.proc.poll()
                if code is None or self.stopping:
                    continue
                if stage.crash_looping():
                    log.error("%s keeps dying (last exit %s); shutting down", stage.name, code)
                    self.stopping, status = True, 1
                    break
                log.warning("%s exited with %s; restarting it", stage.name, code)
                stage.restarts.append(time.monotonic())
                stage.start()
        self.stop_all()
        return status

    def stop_all(self) -> None:
        gateway = [s for s in self.stages if s.name == "gateway"]
        self._stop(gateway, self.drain_timeout_s + 5.0)
        self._stop([s for s in self.stages if s.name != "gateway"], STOP_TIMEOUT_S)

    @staticmethod
    def _stop(stages: list[Stage], timeout_s: float) -> None:
        for stage in stages:
            if stage.proc and stage.proc.poll() is None:
                stage.proc.terminate()
        deadline = time.monotonic() + timeout_s
        for stage in stages:
            if stage.proc is None:
                continue
            try:
                stage.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", stage.name)
                stage.proc.kill()
                stage.proc.wait()


def run(args: argparse.Namespace) -> int:
    resolve_model(args.model)  # convert a GGUF once, before the stages race to load it
    own_run_dir = not os.environ.get("PAGEDSERVE_RUN_DIR")
    run_dir = default_run_dir()
    given = {name: getattr(args, name) for name in Addresses.__dataclass_fields__ if getattr(args, name)}
    addresses = Addresses(**{**Addresses.ipc(run_dir).__dict__, **given})
    envs = {"gateway": {**os.environ, API_KEY_ENV: args.api_key}} if args.api_key else None  # not in `ps`
    supervisor = Supervisor(stage_commands(args, addresses), envs, args.shutdown_timeout)

    def stop(signum, _frame):
        log.info("signal %d: stopping every stage", signum)
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("serving %s on http://%s:%d (stages talk via %s)", args.model, args.host, args.port, run_dir)
    try:
        return supervisor.run()
    finally:
        if own_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
