"""Which device each executor rank gets from `pagedserve serve` (data x tensor parallelism):
the launcher's command lines, parsed by the executor's own parser and resolved per rank as
the executor does, give engine i's rank r GPU first + i*M + r; with fewer GPUs visible the
command refuses to start and says how many it needs (a real `pagedserve serve` process with
CUDA_VISIBLE_DEVICES empty, so this holds on a GPU machine too)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services import launcher
from services.executor import service
from services.stage_options import add_stage_args
from shared.config import Addresses
from tests.helpers import ROOT


def executor_devices(argv: list[str]) -> dict[str, tuple[str, int, str, str]]:
    """Executor stage name -> (engine, rank, device the rank runs on, its rendezvous address)."""
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    cmds = launcher.stage_commands(parser.parse_args(["--model", "tiny", *argv]), Addresses.ipc("/tmp/run"))
    out = {}
    for name, cmd in cmds.items():
        if name.startswith("executor"):
            own = argparse.ArgumentParser()
            add_stage_args(own, "executor")
            args = own.parse_args(cmd[cmd.index("executor") + 1:])
            device = service.rank_device(args.device, args.tp_rank, args.tensor_parallel_size)
            out[name] = (args.engine, args.tp_rank, device, args.tp_init_address)
    return out


def test_two_engines_of_two_ranks_each_take_four_distinct_gpus():
    got = executor_devices(["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--device", "cuda"])
    assert {name: x[:3] for name, x in got.items()} == {
        "executor-0": ("engine-0", 0, "cuda:0"),
        "executor-0-rank1": ("engine-0", 1, "cuda:1"),
        "executor-1": ("engine-1", 0, "cuda:2"),
        "executor-1-rank1": ("engine-1", 1, "cuda:3"),
    }
    # each engine's ranks meet at their own address, apart from the other engine's
    assert got["executor-0"][3] == got["executor-0-rank1"][3] != got["executor-1"][3] == got["executor-1-rank1"][3]


def test_the_gpu_named_is_the_first_and_engines_without_tp_take_one_each():
    got = executor_devices(["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--device", "cuda:4"])
    assert sorted(x[2] for x in got.values()) == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]
    got = executor_devices(["--data-parallel-size", "3", "--device", "cuda"])
    assert {name: x[2] for name, x in got.items()} == {"executor-0": "cuda", "executor-1": "cuda:1",
                                                      "executor-2": "cuda:2"}  # "cuda": torch's GPU 0
    assert executor_devices(["--device", "cuda"])["executor"][2] == "cuda"  # one engine: as given
    cpu = executor_devices(["--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    assert {x[2] for x in cpu.values()} == {"cpu"}


def test_too_few_gpus_is_refused_with_the_count_needed():
    launcher.check_gpus("cuda", 2, 2, visible=4)
    launcher.check_gpus("cpu", 2, 2, visible=0)
    launcher.check_gpus("cuda", 1, 1, visible=0)  # one rank: the executor's own error, as before
    with pytest.raises(SystemExit, match=r"needs 4 GPUs.*GPUs 0-3.*but 3 are visible"):
        launcher.check_gpus("cuda", 2, 2, visible=3)
    with pytest.raises(SystemExit, match=r"needs 2 GPUs.*GPUs 3-4.*but 4 are visible"):
        launcher.check_gpus("cuda:3", 2, 1, visible=4)


def test_serve_refuses_to_start_without_enough_gpus():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model", "tiny",
                           "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--device", "cuda"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "--data-parallel-size 2 x --tensor-parallel-size 2 on --device cuda needs 4 GPUs" in proc.stderr
    assert "but 0 are visible (CUDA_VISIBLE_DEVICES=)" in proc.stderr
