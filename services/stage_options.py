"""Which stage takes which option groups (shared.options): the one table from which every
stage's command line is parsed (`add_stage_args`) and written (`stage_argv`), and from
which `pagedserve serve` takes its own flags (`SERVE_GROUPS`, with the launcher's).

An option group is declared once, beside the code that owns it; a flag of `serve`
reaches every stage that takes its group, forwarded whole (`--max-num-seqs` reaches the
scheduler, which schedules within it, and the executor, sized for it; `--scheduling-policy`
reaches the scheduler, which orders by it, and the gateway, which refuses a priority under
fcfs). Importing this
module loads no stage's code (no torch, no aiohttp, no transformers).
"""

from __future__ import annotations

import argparse

from services.dynamo_worker.options import DynamoOptions
from services.executor.options import ExecutorOptions, ParallelOptions
from services.gateway.options import GatewayOptions
from services.scheduler.options import (
    KVEventsOptions,
    SchedulerOptions,
    SchedulingOptions,
    SpeculativeOptions,
)
from services.tokenizer.options import TokenizerOptions
from shared.config import BatchLimits, ContextOptions, EngineName, LogOptions, ModelOptions, add_address_args
from shared.lora_options import LoraOptions
from shared.options import add_options, from_args, option_classes, to_argv

STAGE_GROUPS: dict[str, tuple[type, ...]] = {
    "gateway": (ModelOptions, GatewayOptions, SchedulingOptions, LoraOptions, LogOptions),
    "tokenizer": (ModelOptions, ContextOptions, TokenizerOptions, LogOptions),
    "scheduler": (EngineName, BatchLimits, ContextOptions, SchedulerOptions, SchedulingOptions, KVEventsOptions,
                  SpeculativeOptions, LoraOptions, LogOptions),
    # the executor takes the speculative options for --speculative draft's model, which it runs
    "executor": (ModelOptions, EngineName, ExecutorOptions, ParallelOptions, SpeculativeOptions, LoraOptions,
                 LogOptions),
    # an engine served to NVIDIA Dynamo (`serve --dynamo`): the scheduler's KV events are relayed
    "dynamo-worker": (ModelOptions, EngineName, ContextOptions, BatchLimits, KVEventsOptions, DynamoOptions,
                      LogOptions),
}

# every stage's groups, each once (the launcher adds its own)
SERVE_GROUPS: tuple[type, ...] = tuple(option_classes([cls for groups in STAGE_GROUPS.values() for cls in groups]))


def add_stage_args(parser: argparse.ArgumentParser, stage: str) -> None:
    """The command line of `pagedserve stage <stage>`: its groups' flags and the addresses."""
    add_options(parser, STAGE_GROUPS[stage])
    add_address_args(parser, required=False)


def stage_configs(stage: str, args: argparse.Namespace) -> list:
    """The stage's option groups, from parsed args (a stage's own, or `serve`'s with the
    per-process fields set)."""
    return [from_args(cls, args) for cls in STAGE_GROUPS[stage]]


def stage_argv(stage: str, args: argparse.Namespace) -> list[str]:
    """The flags that give the stage's parser the configs `stage_configs(stage, args)`."""
    return [flag for config in stage_configs(stage, args) for flag in to_argv(config)]
