"""The one options model (shared/options.py, services/stage_options.py): every flag of `serve`
given a value other than its default reaches each stage that takes its group, through the
argv the launcher writes and the stage's own parser, built from the same dataclasses; and
an option is declared once."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from services import launcher
from services.dynamo_worker.options import DynamoOptions
from services.executor.options import ExecutorOptions
from services.stage_options import SERVE_GROUPS, STAGE_GROUPS, add_stage_args, stage_argv, stage_configs
from shared.config import Addresses, BatchLimits
from shared.options import default_of, flag_of, option_classes, parse_size, positive, to_argv

SET_PER_PROCESS = {"device", "served_model_name"}  # the launcher names these per stage process


def serve_options() -> list:
    return [f for cls in option_classes([*SERVE_GROUPS, launcher.ServeOptions]) for f in fields(cls)
            if "group" not in f.metadata and not f.metadata["stage_only"]]


def other_value(f) -> list[str]:
    """The argv that gives field f a value other than its default."""
    default, meta = default_of(f), f.metadata
    if isinstance(default, bool):
        return [flag_of(f)]
    if meta["choices"]:
        return [flag_of(f), next(c for c in meta["choices"] if c != default)]
    if meta["parse"] is parse_size:
        return [flag_of(f), "3MiB"]
    if meta.get("nargs"):  # a list of NAME=VALUE (--lora-modules)
        return [flag_of(f), f"x={f.name}", "y=2"]
    if isinstance(default, float):
        return [flag_of(f), str(default + 1.5)]
    if isinstance(default, int) or meta["parse"] in (int, positive):
        return [flag_of(f), str((default or 0) + 3)]
    return [flag_of(f), f"x-{f.name}"]


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    return parser.parse_args(argv)


def stage_args(cmd: list[str]) -> tuple[str, argparse.Namespace]:
    stage = cmd[cmd.index("stage") + 1]
    parser = argparse.ArgumentParser()
    add_stage_args(parser, stage)
    return stage, parser.parse_args(cmd[cmd.index("stage") + 2:])


def test_every_serve_flag_reaches_every_stage_that_takes_it_and_the_argv_round_trips():
    argv = []
    for f in serve_options():
        if f.metadata["serve_flag"]:
            argv += [f.metadata["serve_flag"], "3"]
        elif f.name not in ("tokenizer_replicas", "data_parallel_size", "tensor_parallel_size", "dynamo"):
            argv += other_value(f)
    argv += ["--tokenizer-replicas", "2", "--data-parallel-size", "2", "--tensor-parallel-size", "2"]
    args = serve_args(argv)
    for f in serve_options():  # the argv above sets every flag of serve to a value of its own
        if f.name != "dynamo":  # it swaps the gateway and tokenizers for a dynamo-worker (tests/dynamo_worker)
            assert getattr(args, f.name) != default_of(f), f.name
    cmds = launcher.stage_commands(args, Addresses.ipc("/tmp/run"), tp_ports=[29500, 29501])
    assert len(cmds) == 2 + 2 * 2 + 1 + 2  # 2 schedulers, 2 x 2 executor ranks, the gateway, 2 tokenizers
    reached = set()
    for name, cmd in cmds.items():
        stage, parsed = stage_args(cmd)
        # the stage's parser gives back the very configs the launcher wrote
        assert [flag for config in stage_configs(stage, parsed) for flag in to_argv(config)] == \
            stage_argv(stage, parsed) == cmd[cmd.index("stage") + 2:len(cmd) - len(Addresses.ipc("/").as_argv())]
        for cls in option_classes(STAGE_GROUPS[stage]):
            for f in fields(cls):
                if "group" in f.metadata or f.metadata["stage_only"] or not f.metadata["forward"]:
                    continue
                if f.name not in SET_PER_PROCESS:
                    assert getattr(parsed, f.name) == getattr(args, f.name), (name, f.name)
                reached.add(f.name)
    # every option of serve's stages reached one (the API key travels in the gateway's environment;
    # the dynamo-worker's only under --dynamo: tests/dynamo_worker/test_dynamo_launch.py)
    assert reached | {"api_key"} == ({f.name for f in serve_options()} - {f.name for f in fields(launcher.ServeOptions)}
                                     - {f.name for f in fields(DynamoOptions)})
    executors = {name: stage_args(cmd)[1] for name, cmd in cmds.items() if name.startswith("executor")}
    assert {(a.engine, a.tp_rank, a.tp_init_address, a.device) for a in executors.values()} == {
        (f"engine-{i}", r, f"tcp://127.0.0.1:{29500 + i}", "x-device") for i in range(2) for r in range(2)}
    assert stage_args(cmds["gateway"])[1].served_model_name == "x-served_model_name"
    assert [stage_args(cmds[f"tokenizer-{i}"])[1].replica for i in range(2)] == ["tokenizer-0", "tokenizer-1"]


def test_the_gateway_reaches_every_engines_scheduler_and_the_tokenizers_none():
    run = Addresses.ipc("/tmp/run")
    cmds = launcher.stage_commands(serve_args(["--data-parallel-size", "2", "--tokenizer-replicas", "2"]), run)
    schedulers = [stage_args(cmds[f"scheduler-{i}"])[1].scheduler_in for i in range(2)]
    assert schedulers == [run.scheduler_in, run.scheduler_in.replace(".ipc", "-1.ipc")]
    assert stage_args(cmds["gateway"])[1].scheduler_in == ",".join(schedulers)  # engine i at position i
    for i in range(2):  # the plain addresses: a replica answers the gateway and reaches no scheduler
        assert cmds[f"tokenizer-{i}"][-len(run.as_argv()):] == run.as_argv()


def test_defaults_go_unsaid_and_parse_back_to_the_defaults():
    cmds = launcher.stage_commands(serve_args(["--cpu-placement", "off"]), Addresses.ipc("/tmp/run"))
    assert cmds["executor"][cmds["executor"].index("stage") + 2:cmds["executor"].index("--tokenizer-in")] == []
    stage, parsed = stage_args(cmds["executor"])
    assert stage_configs(stage, parsed)[2] == ExecutorOptions()


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-batched-tokens"])
def test_a_step_limit_declared_once_reaches_the_scheduler_and_the_executor(flag):
    declared = [(cls.__name__, f.name) for cls in option_classes([*SERVE_GROUPS, launcher.ServeOptions])
                for f in fields(cls) if flag_of(f) == flag]
    assert declared == [("BatchLimits", flag[2:].replace("-", "_"))]
    cmds = launcher.stage_commands(serve_args([flag, "7"]), Addresses.ipc("/tmp/run"))
    for name in ("scheduler", "executor"):
        stage, parsed = stage_args(cmds[name])
        assert getattr(parsed, flag[2:].replace("-", "_")) == 7
    executor = stage_configs("executor", stage_args(cmds["executor"])[1])[2]
    assert getattr(executor.limits, flag[2:].replace("-", "_")) == 7
    assert getattr(BatchLimits(), flag[2:].replace("-", "_")) != 7


def test_every_flag_of_serve_has_help_and_is_declared_once():
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)  # argparse refuses a flag declared twice
    names = [f.name for f in serve_options()]
    assert len(names) == len(set(names))
    assert all(f.metadata["help"] for f in serve_options())
    text = parser.format_help()
    for f in serve_options():
        assert (f.metadata["serve_flag"] or flag_of(f)) in text
