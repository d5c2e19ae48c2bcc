"""`pagedserve serve`: start every stage as its own OS process and keep them alive.

Each stage runs as `python -m services.cli stage NAME ...`, so `ps` names it. They
talk over ipc:// sockets in a private run directory unless tcp:// addresses are
given. A stage that dies is restarted (the others reconnect on their own), again and
again: one that keeps dying waits longer each time (exponential backoff, capped), and
one that then runs a while is forgiven its past. The launcher never gives up on its own;
only SIGINT/SIGTERM stop it, and the stages in order: the gateway first, which drains
(finishes the requests in flight, up to --shutdown-timeout), then the others, which the
drain still needed. Restarts and backoffs are written to a state file the gateway shows
on /health and /metrics (services/gateway/supervision.py).

With `--dynamo` the engine is served to NVIDIA Dynamo: a dynamo-worker stage
(services/dynamo_worker) takes the place of the gateway and the tokenizer replicas (Dynamo's
frontend tokenizes and serves HTTP); it is stopped first, as the gateway is, to drain.

With `--tensor-parallel-size N` each engine's executor is N stages, "executor" (rank 0,
the one the scheduler talks to) and "executor-rank1" ... (with data parallelism
"executor-0", "executor-0-rank1", ...), which meet at a tcp:// port of 127.0.0.1 chosen
at launch. They form a group: when one of them dies the launcher kills the others at
once and starts them all again together (one backoff for the group), since a group
that lost a rank cannot continue.

On CUDA every executor rank has a GPU of its own: engine i's rank r takes GPU
first + i*M + r (M the tensor-parallel size, first the index in `--device cuda:K`, else
0). The launcher gives engine i `--device cuda:{first + i*M}` and each rank adds its rank
(`services.executor.service.rank_device`). With fewer GPUs visible than that needs it
refuses to start, naming the count, instead of letting engines share a GPU (each sizes
its KV pool to --gpu-memory-utilization of the whole device) or fail one by one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.gateway.options import API_KEY_ENV
from services.gateway.supervision import STATE_ENV
from services.stage_options import SERVE_GROUPS, stage_argv
from shared import cpu_placement
from shared.config import Addresses, add_address_args, default_run_dir, engine_addresses
from shared.curve import load_keys
from shared.model_files import default_served_name, resolve_model
from shared.options import add_options, option
from shared.ports import free_port

log = logging.getLogger("pagedserve.launcher")

BACKOFF_BASE_S = 0.5  # the wait before the first restart; doubled for each death in a row
BACKOFF_CAP_S = 30.0
STABLE_S = 60.0  # a stage that ran this long before dying starts again from BACKOFF_BASE_S
POLL_S = 0.2
STOP_TIMEOUT_S = 10.0  # for each stage but the draining gateway
FRONT_STAGES = ("gateway", "dynamo-worker")  # stopped first, and given time to drain


@dataclass(frozen=True)
class ServeOptions:
    """serve (the stages it starts, and where they run)"""

    tokenizer_replicas: int = option(1, "tokenizer processes (each a stage of its own)")
    data_parallel_size: int = option(1, "engines (a scheduler and its executor each, with its own model copy and "
                                        "KV pool)")
    frontend_nice: int = option(0, "niceness added to the gateway and tokenizer processes, so that on a machine "
                                   "they share with the executor its compute threads are preempted less (see "
                                   "benchmarks/placement.py)")
    cpu_placement: str = option("auto", "auto: on the CPU with one engine of one rank, the executor's main thread "
                                        "keeps the first allowed core to itself and every other thread and stage "
                                        "shares the rest (shared.cpu_placement); off: the OS places everything",
                                choices=("auto", "off"))
    dynamo: bool = option(False, "serve the engine to NVIDIA Dynamo instead of over HTTP: a dynamo-worker stage "
                                 "(services/dynamo_worker) in place of the gateway and tokenizers, registering "
                                 "with Dynamo's frontend (the dynamo extra; see README, Dynamo); run one such serve "
                                 "per engine, Dynamo's router balances them")


def add_args(parser: argparse.ArgumentParser) -> None:
    """`serve`'s flags: every stage's option groups (services.stage_options) and its own."""
    add_options(parser, (*SERVE_GROUPS, ServeOptions), serve=True)
    add_address_args(parser, required=False)


RANK_SUFFIX = "-rank"  # stage names of tensor-parallel ranks > 0: executor-rank1, executor-0-rank1, ...


def first_gpu(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def engine_device(device: str, engine: int, tensor_parallel_size: int) -> str:
    """The --device of engine `engine`'s executor ranks: on CUDA the first of its own GPUs."""
    if not device.startswith("cuda") or engine == 0:
        return device
    return f"cuda:{first_gpu(device) + engine * tensor_parallel_size}"


def check_gpus(device: str, data_parallel_size: int, tensor_parallel_size: int, visible: int) -> None:
    """Refuse (SystemExit) a CUDA layout that needs more GPUs than `visible`."""
    ranks = data_parallel_size * tensor_parallel_size
    if not device.startswith("cuda") or ranks == 1:
        return
    first = first_gpu(device)
    if first + ranks > visible:
        raise SystemExit(
            f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size {tensor_parallel_size} on "
            f"--device {device} needs {ranks} GPUs, one per executor rank (GPUs {first}-{first + ranks - 1}: "
            f"engine i, rank r on GPU {first} + i*{tensor_parallel_size} + r), but {visible} "
            f"{'is' if visible == 1 else 'are'} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def visible_gpus() -> int:
    import torch  # only for --device cuda: the launcher does not load torch otherwise

    return torch.cuda.device_count()


def stage_groups(names: list[str]) -> dict[str, str]:
    """Stage name -> its group (an executor's tensor-parallel ranks), for the stages in one."""
    ranks = {name: name.rsplit(RANK_SUFFIX, 1)[0] for name in names if RANK_SUFFIX in name}
    return {**{group: group for group in ranks.values()}, **ranks}


def stage_commands(args: argparse.Namespace, addresses: Addresses,
                   tp_ports: list[int] | None = None) -> dict[str, list[str]]:
    """The command line of every stage process, by a unique stage name (tp_ports: each engine's
    tensor-parallel rendezvous port, else free ones now). Each stage gets its option groups
    whole (services.stage_options), with what names the process set here."""
    base = [sys.executable, "-m", "services.cli", "stage"]
    keys = ["--curve-key-file", args.curve_key_file] if getattr(args, "curve_key_file", None) else []

    def command(stage: str, addrs: Addresses, **own) -> list[str]:
        return base + [stage] + stage_argv(stage, argparse.Namespace(**{**vars(args), **own})) + addrs.as_argv() + keys

    cmds = {}
    # one engine: stages "scheduler" and "executor"; several: "scheduler-0", "executor-0", ...
    dp = getattr(args, "data_parallel_size", 1)
    tp = getattr(args, "tensor_parallel_size", 1)
    engines = engine_addresses(addresses, dp)
    if tp > 1 and tp_ports is None:
        tp_ports = [free_port() for _ in engines]
    for i, engine in enumerate(engines):
        suffix, name = (f"-{i}" if dp > 1 else ""), f"engine-{i}"
        cmds[f"scheduler{suffix}"] = command("scheduler", engine, engine=name)
        executor = {"engine": name, "device": engine_device(args.device, i, tp),
                    "keep_main_core": shared_cores(args) is not None}
        if tp == 1:
            cmds[f"executor{suffix}"] = command("executor", engine, **executor)
            continue
        for rank in range(tp):
            cmds[f"executor{suffix}" + (f"{RANK_SUFFIX}{rank}" if rank else "")] = command(
                "executor", engine, **executor, tp_rank=rank, tp_init_address=f"tcp://127.0.0.1:{tp_ports[i]}")
    served = default_served_name(args.model) if args.served_model_name is None else args.served_model_name
    if getattr(args, "dynamo", False):  # Dynamo's frontend tokenizes and serves HTTP: no gateway, no tokenizer
        cmds["dynamo-worker"] = command("dynamo-worker", engines[0], engine="engine-0",
                                        dynamo_model_name=getattr(args, "dynamo_model_name", None) or served)
        return cmds
    # the gateway sends each request on to one engine's scheduler: it reaches every one
    every = Addresses(**{**addresses.__dict__, "scheduler_in": ",".join(e.scheduler_in for e in engines)})
    cmds["gateway"] = command("gateway", every, served_model_name=served)
    for i in range(args.tokenizer_replicas):
        cmds[f"tokenizer-{i}"] = command("tokenizer", addresses, replica=f"tokenizer-{i}")
    return cmds


def shared_cores(args: argparse.Namespace) -> set[int] | None:
    """The cores the stages other than the executor run on, where `--cpu-placement auto` keeps
    one for the executor's main thread: one engine of one rank on the CPU, two cores or more."""
    if getattr(args, "cpu_placement", "off") != "auto" or not args.device.startswith("cpu"):
        return None
    if getattr(args, "data_parallel_size", 1) * getattr(args, "tensor_parallel_size", 1) != 1:
        return None
    parts = cpu_placement.split()
    return None if parts is None else parts[1]


@dataclass
class Stage:
    name: str
    cmd: list[str]
    env: dict[str, str] | None = None
    nice: int = 0  # added to the process's niceness at start
    cpus: set[int] | None = None  # the cores it moves to once ready (None: those of the launcher)
    proc: subprocess.Popen | None = None
    failures: int = 0  # deaths in a row, each after less than STABLE_S
    restarts_total: int = 0
    restart_at: float | None = None  # monotonic; set while it is down
    starts: list[float] = field(default_factory=list)  # monotonic, the latest few
    delays: list[float] = field(default_factory=list)  # backoffs chosen, the latest few

    def start(self) -> None:
        nice = self.nice
        env = self.env
        if self.cpus is not None:  # the stage moves there itself once ready (shared.cpu_placement.settle)
            env = {**(env if env is not None else os.environ), **cpu_placement.stage_cpus_env(self.cpus)}
        self.proc = subprocess.Popen(self.cmd, start_new_session=False, env=env,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.restart_at = None
        self.starts = self.starts[-63:] + [time.monotonic()]
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def died(self, code: int, base_s: float, cap_s: float, stable_s: float) -> float:
        """Note a death; the seconds to wait before the next start."""
        now = time.monotonic()
        self.failures = 1 if now - self.starts[-1] >= stable_s else self.failures + 1
        delay = min(base_s * 2 ** (self.failures - 1), cap_s)
        self.delays = self.delays[-63:] + [delay]
        self.proc, self.restart_at = None, now + delay
        log.warning("%s exited with %s (%d in a row); restarting it in %g s", self.name, code, self.failures, delay)
        return delay


class Supervisor:
    def __init__(self, commands: dict[str, list[str]], envs: dict[str, dict[str, str]] | None = None,
                 drain_timeout_s: float = 0.0, backoff_base_s: float = BACKOFF_BASE_S,
                 backoff_cap_s: float = BACKOFF_CAP_S, stable_s: float = STABLE_S, state_path: str | None = None,
                 nice: dict[str, int] | None = None, cpus: dict[str, set[int]] | None = None):
        envs, nice, cpus = envs or {}, nice or {}, cpus or {}
        self.stages = [Stage(name, cmd, envs.get(name), nice.get(name, 0), cpus.get(name))
                       for name, cmd in commands.items()]
        self.groups = stage_groups(list(commands))
        self.drain_timeout_s = drain_timeout_s
        self.backoff_base_s, self.backoff_cap_s, self.stable_s = backoff_base_s, backoff_cap_s, stable_s
        self.state_path = state_path
        self.stopping = False

    def run(self) -> int:
        """Keep every stage running until told to stop; then stop them all and return 0."""
        for stage in self.stages:
            stage.start()
        self._write_state()
        while not self.stopping:
            time.sleep(min(POLL_S, self.backoff_base_s))
            changed = False
            for stage in self.stages:
                if self.stopping:
                    break
                if stage.proc is not None:
                    code = stage.proc.poll()
                    if code is not None:
                        stage.died(code, self.backoff_base_s, self.backoff_cap_s, self.stable_s)
                        self._stop_group_of(stage)
                        changed = True
                if stage.proc is None and time.monotonic() >= stage.restart_at:
                    stage.restarts_total += 1
                    stage.start()
                    changed = True
            if changed:
                self._write_state()
        self.stop_all()
        return 0

    def _stop_group_of(self, dead: Stage) -> None:
        """Kill the rest of a dead stage's group; all of them start again when it does."""
        group = self.groups.get(dead.name)
        if group is None:
            return
        for peer in self.stages:
            if peer is dead or self.groups.get(peer.name) != group:
                continue
            if peer.proc is not None:
                code = peer.proc.poll()
                if code is None:
                    log.warning("%s: killing it too, its group lost %s", peer.name, dead.name)
                    peer.proc.kill()
                else:  # both ended before this poll: a rank that saw its peer go exits on its own
                    log.warning("%s exited with %s too; its group lost %s", peer.name, code, dead.name)
                peer.proc.wait()
                peer.proc = None
            peer.restart_at = dead.restart_at

    def _write_state(self) -> None:
        if self.state_path is None:
            return
        now_mono, now = time.monotonic(), time.time()
        state = {"stages": {s.name: {
            "restarts": s.restarts_total,
            "pid": s.proc.pid if s.proc is not None else None,
            "restart_at": None if s.restart_at is None else now + (s.restart_at - now_mono),
        } for s in self.stages}}
        tmp = f"{self.state_path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.state_path)  # the gateway never reads half a file
        except OSError:
            log.warning("cannot write %s", self.state_path, exc_info=True)

    def stop_all(self) -> None:
        front = [s for s in self.stages if s.name in FRONT_STAGES]
        self._stop(front, self.drain_timeout_s + 5.0)
        self._stop([s for s in self.stages if s.name not in FRONT_STAGES], STOP_TIMEOUT_S)

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
    if args.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be at least 1")
    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be at least 1")
    if args.dynamo and args.data_parallel_size > 1:
        raise SystemExit("--dynamo serves one engine: run one `pagedserve serve --dynamo` per engine (each its own "
                         "Dynamo worker; Dynamo's router balances them) instead of --data-parallel-size")
    if args.device.startswith("cuda") and args.data_parallel_size * args.tensor_parallel_size > 1:
        check_gpus(args.device, args.data_parallel_size, args.tensor_parallel_size, visible_gpus())
    # refuse now, not in every stage: the addresses given are the only tcp:// ones
    load_keys(getattr(args, "curve_key_file", None), [getattr(args, name) for name in Addresses.__dataclass_fields__])
    resolve_model(args.model)  # convert a GGUF once, before the stages race to load it
    own_run_dir = not os.environ.get("PAGEDSERVE_RUN_DIR")
    run_dir = default_run_dir()
    given = {name: getattr(args, name) for name in Addresses.__dataclass_fields__ if getattr(args, name)}
    addresses = Addresses(**{**Addresses.ipc(run_dir).__dict__, **given})
    state_path = os.path.join(run_dir, "supervisor.json")
    gateway_env = {**os.environ, STATE_ENV: state_path}
    if args.api_key:
        gateway_env[API_KEY_ENV] = args.api_key  # not in `ps`
    commands = stage_commands(args, addresses)
    frontend = {name: args.frontend_nice for name in commands if name == "gateway" or name.startswith("tokenizer")}
    shared = shared_cores(args)
    cpus = {} if shared is None else {name: shared for name in commands if not name.startswith("executor")}
    if shared is not None:
        log.info("CPU placement: the executor's main thread keeps a core to itself; the other stages run on cores %s",
                 ",".join(map(str, sorted(shared))))
    supervisor = Supervisor(commands, {"gateway": gateway_env}, args.shutdown_timeout, state_path=state_path,
                            nice=frontend, cpus=cpus)

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
