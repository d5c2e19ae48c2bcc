"""`pagedserve serve --dynamo`: the dynamo-worker stage in place of the gateway and tokenizers,
with the options it needs forwarded; refused with several engines. `stage dynamo-worker`
parses them back (no Dynamo needed)."""

from __future__ import annotations

import argparse

import pytest

from services import launcher
from services.cli import build_parser, stage_module
from shared.config import Addresses


def commands(argv: list[str]) -> dict[str, list[str]]:
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    return launcher.stage_commands(parser.parse_args(argv), Addresses.ipc("/tmp/run"))


def test_serve_dynamo_starts_scheduler_executor_and_the_worker():
    cmds = commands(["--dynamo", "--model", "m", "--served-model-name", "tiny", "--kv-events-endpoint",
                     "tcp://127.0.0.1:5557", "--dynamo-discovery-backend", "file", "--max-model-len", "256"])
    assert set(cmds) == {"scheduler", "executor", "dynamo-worker"}
    worker = cmds["dynamo-worker"]
    args = build_parser().parse_args(worker[worker.index("stage"):])
    assert (args.stage, args.dynamo_model_name, args.kv_events_endpoint) == ("dynamo-worker", "tiny",
                                                                               "tcp://127.0.0.1:5557")
    assert (args.dynamo_discovery_backend, args.max_model_len, args.engine) == ("file", 256, "engine-0")
    assert args.scheduler_in == "ipc:///tmp/run/scheduler-in.ipc" and args.status == "ipc:///tmp/run/status.ipc"
    scheduler = cmds["scheduler"]
    assert "--kv-events-endpoint" in scheduler  # the scheduler publishes what the worker relays
    assert "gateway" not in cmds and not any(name.startswith("tokenizer") for name in cmds)


def test_serve_dynamo_names_the_model_after_the_model_by_default():
    worker = commands(["--dynamo", "--model", "/models/my-model/"])["dynamo-worker"]
    assert worker[worker.index("--dynamo-model-name") + 1] == "my-model"


def test_serve_dynamo_refuses_several_engines():
    args = build_parser().parse_args(["serve", "--dynamo", "--data-parallel-size", "2"])
    with pytest.raises(SystemExit, match="one `pagedserve serve --dynamo` per engine"):
        launcher.run(args)


def test_the_stage_module_loads_without_dynamo():
    assert stage_module("dynamo-worker").run  # dynamo itself is imported when the stage runs
