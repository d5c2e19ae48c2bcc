"""Tensor parallelism (issue 12) over gloo on the CPU, with real processes.

- Logits: a TP=2 ModelRunner (two rank processes, `tests.executor.tp_ranks`, the followers in
  the executor stage's own loop) against TP=1 in this process, float32, no quantization:
  every step's logits within 1e-4 and the greedy tokens equal, for the tiny random Llama
  (4 heads, 2 KV heads: one KV group per rank) and for SmolLM2 (9 heads, 3 KV heads:
  split unevenly, rank 0 holds KV heads 0-1, rank 1 KV head 2; no KV head replicated).
- Serving: `pagedserve serve --tensor-parallel-size 2` through the HTTP API gives the
  greedy output of `--tensor-parallel-size 1`, for the base model and for requests under two
  LoRA adapters (`--lora-modules`) mixed with it; kill -9 of rank 1 mid-run restarts the
  whole executor group, the scheduler recomputes, and every request completes with the
  output of an undisturbed run. The launcher's group rule alone, on sleeping
  processes: a dead rank restarts its whole group and no other stage. Without a
  launcher (compose), an idle rank whose peer is killed exits by itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from services.executor.models.sharding import ModelShard
from services.executor.tp_group import KEEPALIVE_S, TPGroup
from services.launcher import Supervisor
from shared.ports import free_port
from tests.conftest import needs_smollm2
from tests.e2e.load import dumps, greedy, prompts, run_load
from tests.executor.tp_ranks import drive, make_runner
from tests.helpers import ROOT, ServerProcess
from tests.launcher.test_launcher import BASE_S, CAP_S, SLEEPER, wait_for
from tests.lora_helpers import make_peft_adapter

TOLERANCE = 1e-4
LOGIT_TOLERANCE = 1.0  # quantized (int4, bfloat16 activations): as tests/executor/test_cpu_fast_path.py
# TP 2 against TP 1, both quantized: each rank's row-parallel partial sums are rounded to bfloat16 before
# they are added, 60 times over 30 layers, on top of the fast path's own rounding. The largest prefill
# logit difference was under 1.0 on the Intel Xeons this suite ran on, and 1.04 on an AMD EPYC (Zen 4);
# the greedy tokens agree on both.
TP_LOGIT_TOLERANCE = 1.5
MAX_TOKENS = 8


def test_shards_split_kv_groups_unevenly_or_replicate():
    smol = [ModelShard.of(9, 3, 1536, 49152, rank, 2) for rank in range(2)]
    assert [(s.q_heads, s.kv_heads) for s in smol] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert [s.intermediate for s in smol] == [range(0, 768), range(768, 1536)]
    assert [s.vocab for s in smol] == [range(0, 24576), range(24576, 49152)]
    # fewer KV heads than ranks: each KV head on two ranks, its query heads split between them
    four = [ModelShard.of(8, 2, 128, 10, rank, 4) for rank in range(4)]
    assert [(s.q_heads, s.kv_heads) for s in four] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)), (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]
    assert [s.vocab for s in four] == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]  # padded to 3 rows
    with pytest.raises(ValueError):
        ModelShard.of(9, 3, 1536, 49152, 0, 6)  # 3 query heads per KV head do not split over 2 replicas


def stop_ranks(procs: list[subprocess.Popen]) -> None:
    """Kill the rank processes still running and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def run_tp2(model: str, prompt_ids: list[list[int]], out, extra: tuple[str, ...] = ()) -> dict:
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.executor.tp_ranks", "--model", model, "--rank", str(rank),
                               "--size", "2", "--init", init, "--prompts", json.dumps(prompt_ids),
                               "--max-tokens", str(MAX_TOKENS), "--out", str(out), *extra], cwd=ROOT)
             for rank in range(2)]
    try:
        assert [p.wait(600) for p in procs] == [0, 0]
    finally:
        stop_ranks(procs)
    return torch.load(out)


def compare(model: str, prompt_ids: list[list[int]], tmp_path, kv_heads_rank0: int) -> None:
    got = run_tp2(model, prompt_ids, tmp_path / "tp2.pt")
    torch.set_num_threads(1)  # as the ranks: the same matmul blocking
    ref_logits, ref_tokens = drive(make_runner(model, TPGroup.single()), TPGroup.single(), prompt_ids, MAX_TOKENS)
    assert got["kv_heads"] == kv_heads_rank0
    assert len(got["logits"]) == len(ref_logits) == MAX_TOKENS
    worst = 0.0
    for step, (a, b) in enumerate(zip(got["logits"], ref_logits, strict=True)):
        assert a.shape == b.shape
        diff = (a - b).abs().max().item()
        assert diff <= TOLERANCE, f"step {step}: logits differ by {diff}"
        worst = max(worst, diff)
    assert got["tokens"] == ref_tokens
    print(f"TP 2 vs 1: logits differ by at most {worst:.2e}")


def smollm2_prompts() -> tuple[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from shared.model_files import resolve_model

    model = str(resolve_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(model)
    texts = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]
    return model, [tok.encode(t) for t in texts]


def test_tiny_llama_tp2_logits_equal_tp1(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    prompt_ids = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 11, 17)]
    compare(str(tiny_model_dir), prompt_ids, tmp_path, kv_heads_rank0=1)


@needs_smollm2
def test_smollm2_tp2_logits_equal_tp1(tmp_path):
    model, prompt_ids = smollm2_prompts()
    compare(model, prompt_ids, tmp_path, kv_heads_rank0=2)


@needs_smollm2
def test_smollm2_int4_copies_per_shard(tmp_path):
    """`--quantization auto` on SmolLM2's Q4_1 checkpoint under TP 2: every rank's shards get
    their int4 (decoder) and int8 (head) copies, and used on every step they stay within the
    CPU fast path's stated tolerance of TP 1's quantized logits (the int4 kernel rounds its
    output to bfloat16, and the row-parallel layers round each rank's partial sum, so the
    two differ by bfloat16 rounding, not by 1e-4; tests/executor/test_cpu_fast_path.py)."""
    model, prompt_ids = smollm2_prompts()
    got = run_tp2(model, prompt_ids, tmp_path / "int4.pt", ("--quantization", "auto", "--int4-max-rows", "256"))
    assert got["int4"] and got["int8_head"]
    torch.set_num_threads(1)
    runner = make_runner(model, TPGroup.single(), "auto", 256)
    ref_logits, ref_tokens = drive(runner, TPGroup.single(), prompt_ids, MAX_TOKENS)
    prefill = (got["logits"][0] - ref_logits[0]).abs().max().item()
    assert prefill <= TP_LOGIT_TOLERANCE, prefill
    assert [t[0] for t in got["tokens"]] == [t[0] for t in ref_tokens]


def test_a_dead_tensor_parallel_rank_restarts_its_whole_group_and_nothing_else():
    names = ["executor", "executor-rank1", "executor-rank2", "scheduler"]
    sup = Supervisor({name: SLEEPER for name in names}, backoff_base_s=BASE_S, backoff_cap_s=CAP_S)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: all(s.proc is not None for s in sup.stages), "the stages to start")
        pids = {s.name: s.proc.pid for s in sup.stages}
        os.kill(pids["executor-rank1"], 9)
        group = [s for s in sup.stages if s.name.startswith("executor")]
        wait_for(lambda: all(s.restarts_total == 1 and s.proc is not None for s in group), "the group's restart")
        for stage in group:
            assert stage.proc.pid != pids[stage.name] and stage.proc.poll() is None
        scheduler = sup.stages[-1]
        assert scheduler.restarts_total == 0 and scheduler.proc.pid == pids["scheduler"]
        assert [s.failures for s in group] == [0, 1, 0]  # the one that died counts it
    finally:
        sup.stopping = True
        thread.join(30)
    assert result == [0]


def start_ranks(model, tmp_path, port: int) -> list[subprocess.Popen]:
    """The executor stage's two ranks alone (as compose runs them: no launcher); rank 0's
    scheduler sockets lead nowhere, which an idle executor does not mind."""
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-m", "services.cli", "stage", "executor", "--model", str(model),
               "--dtype", "float32", "--quantization", "none", "--num-kv-blocks", "64", "--threads", "1",
               "--tensor-parallel-size", "2", "--tp-rank", str(rank), "--tp-init-address", f"tcp://127.0.0.1:{port}",
               "--executor-in", f"ipc://{tmp_path}/in.ipc", "--executor-out", f"ipc://{tmp_path}/out.ipc"]
        log = open(tmp_path / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.parametrize("victim", [1, 0])
def test_an_idle_rank_whose_peer_dies_exits(tiny_model_dir, tmp_path, victim):
    """Without a launcher (compose), a dead rank must still take its group down, so that
    every rank restarts: rank 0 notices through its keepalive, rank 1 through its wait."""
    procs = start_ranks(tiny_model_dir, tmp_path, free_port())
    try:
        logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
        wait_for(lambda: re.search(r"executor executor-\d+ ready", logs[0].read_text())
                 and "rank 1 of 2 ready" in logs[1].read_text(), "both ranks ready", timeout=120)
        time.sleep(2 * KEEPALIVE_S)  # idle: keepalives only
        assert all(p.poll() is None for p in procs)
        procs[victim].kill()
        survivor = 1 - victim
        assert procs[survivor].wait(30) == 1, logs[survivor].read_text()
        assert "exiting so that the group restarts" in logs[survivor].read_text()
    finally:
        stop_ranks(procs)


# --- the rendezvous: loopback only, unless asked for --------------------------------------

JOIN_AND_REPORT = """
import json, os, socket, sys, torch
from services.executor.tp_group import TPGroup
rank, address, insecure = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
group = TPGroup.join(rank, 2, address, torch.device("cpu"), timeout_s=60, allow_insecure=insecure)
total = group.all_reduce(torch.tensor([rank + 1.0]))
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue  # listdir's own
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for row in open(table).read().splitlines()[1:]:
        cols = row.split()
        if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, one of this process's sockets
            listening.append(cols[1].split(":")[0])
print(json.dumps({"sum": total.item(), "listening": listening}))
group.close()
"""
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net shows them


def join_pair(address: str, insecure: bool) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, "-c", JOIN_AND_REPORT, str(rank), address, "1" if insecure else "0"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")})
             for rank in range(2)]
    for p in procs:
        p.out, p.err = p.communicate(timeout=120)
    return procs


def test_the_rendezvous_listens_on_loopback_alone():
    """Rank 0's store and both ranks' gloo listeners bind loopback addresses only (torch's
    own tcp:// rendezvous listens on every interface)."""
    for p in join_pair(f"tcp://127.0.0.1:{free_port()}", insecure=False):
        assert p.returncode == 0, p.err
        report = json.loads(p.out.splitlines()[-1])
        assert report["sum"] == 3.0
        assert report["listening"] and set(report["listening"]) <= LOOPBACK_HEX, report


def test_a_network_rendezvous_is_refused_without_the_flag(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="refusing the tensor-parallel rendezvous at tcp://10.0.0.2:29500.*"
                                         "--allow-insecure-tp-rendezvous"):
        TPGroup.join(1, 2, "tcp://10.0.0.2:29500", torch.device("cpu"), timeout_s=5)
    for address in ("tcp://0.0.0.0:1", "tcp://127.0.0.1.evil.invalid:1", "tcp://*:1"):
        with pytest.raises(SystemExit, match="refusing the tensor-parallel rendezvous"):
            TPGroup.join(0, 2, address, torch.device("cpu"), timeout_s=5)
    # the executor stage refuses before it loads anything
    env = {**os.environ, "PAGEDSERVE_ALLOW_INSECURE_TP_RENDEZVOUS": ""}
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "stage", "executor", "--model", str(tiny_model_dir),
         "--tensor-parallel-size", "2", "--tp-rank", "1", "--tp-init-address", "tcp://0.0.0.0:29500",
         "--executor-in", f"ipc://{tmp_path}/in.ipc", "--executor-out", f"ipc://{tmp_path}/out.ipc"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "refusing the tensor-parallel rendezvous" in result.stderr and "--allow-insecure-tp-rendezvous" in result.stderr


def test_the_flag_lets_a_network_rendezvous_through_with_a_warning():
    for p in join_pair(f"tcp://0.0.0.0:{free_port()}", insecure=True):  # 0.0.0.0: a network address
        assert p.returncode == 0, p.err
        assert json.loads(p.out.splitlines()[-1])["sum"] == 3.0
        assert "unauthenticated and unencrypted" in p.err and "--allow-insecure-tp-rendezvous" in p.err


def test_serve_passes_the_flag_to_every_rank(tiny_model_dir):
    from services.cli import build_parser
    from services.launcher import stage_commands
    from shared.config import Addresses

    for flag, expected in (([], False), (["--allow-insecure-tp-rendezvous"], True)):
        args = build_parser().parse_args(["serve", "--model", str(tiny_model_dir), "--tensor-parallel-size", "2", *flag])
        cmds = stage_commands(args, Addresses.ipc("/tmp/x"), tp_ports=[29500])
        ranks = [cmd for name, cmd in cmds.items() if name.startswith("executor")]
        assert len(ranks) == 2
        assert all(("--allow-insecure-tp-rendezvous" in cmd) == expected for cmd in ranks)
        assert all("tcp://127.0.0.1:29500" in cmd for cmd in ranks)


# --- serving through the HTTP API ----------------------------------------------------------

SERVE = ["--dtype", "float32", "--quantization", "none", "--served-model-name", "tiny-llama", "--num-kv-blocks", "1024"]


ADAPTERS = [("first", 8, 1), ("second", 4, 2)]  # (name, rank, seed)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    modules = [f"{name}={make_peft_adapter(tiny_model_dir, root / name, rank=rank, seed=seed, scale=3.0)}"
               for name, rank, seed in ADAPTERS]
    serve = SERVE + ["--max-lora-rank", "16", "--lora-modules", *modules]
    tp1 = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("tp1"), serve)
    tp2 = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("tp2"), serve + ["--tensor-parallel-size", "2"])
    with tp1, tp2:
        yield tp1, tp2


def rank_pids(server) -> dict[str, int | None]:
    stages = json.loads((server.run_dir / "supervisor.json").read_text())["stages"]
    return {name: stages[name]["pid"] for name in ("executor", "executor-rank1")}


def test_tp2_server_greedy_equals_tp1(servers):
    tp1, tp2 = servers
    bodies = [greedy(p, 24) for p in prompts(6, seed=21)]
    stream_bodies = [greedy(p, 24, stream=True) for p in prompts(2, seed=22)]
    expected = asyncio.run(run_load(tp1.url, bodies, stream_bodies))
    assert all(r[0] == 200 for r in expected), dumps(expected)
    got = asyncio.run(run_load(tp2.url, bodies, stream_bodies))
    assert got == expected, tp2.log()
    tp2.wait_blocks_free()


def test_tp2_server_adapters_equal_tp1(servers):
    """Requests under two adapters and the base in the same steps (each prompt under each)."""
    tp1, tp2 = servers
    models = ["first", "tiny-llama", "second"]
    bodies = [{**greedy(p, 16), "model": model} for p in prompts(2, seed=23) for model in models]
    stream_bodies = [{**greedy(p, 16, stream=True), "model": "second"} for p in prompts(1, seed=24)]
    expected = asyncio.run(run_load(tp1.url, bodies, stream_bodies))
    assert all(r[0] == 200 for r in expected), dumps(expected)
    assert all(len({tuple(r[1]) for r in expected[i : i + 3]}) == 3 for i in (0, 3))  # the adapters change it
    got = asyncio.run(run_load(tp2.url, bodies, stream_bodies))
    assert got == expected, tp2.log()
    tp2.wait_blocks_free()


def test_rank1_killed_mid_run_restarts_the_group_and_every_request_completes(servers):
    tp1, tp2 = servers
    bodies = [greedy(p, 64) for p in prompts(8, seed=31)]
    stream_bodies = [greedy(p, 64, stream=True) for p in prompts(2, seed=32)]
    reference = asyncio.run(run_load(tp1.url, bodies, stream_bodies))
    assert all(r[0] == 200 for r in reference), dumps(reference)
    old = rank_pids(tp2)
    preemptions = tp2.metrics()["pagedserve_num_preemptions_total"]
    killed = []

    def kill_on_first_chunk():
        if not killed:
            os.kill(old["executor-rank1"], signal.SIGKILL)
            killed.append(time.monotonic())

    results = asyncio.run(run_load(tp2.url, bodies, stream_bodies, on_chunk=kill_on_first_chunk))
    assert killed
    assert results == reference, tp2.log()
    new = rank_pids(tp2)
    assert new["executor"] != old["executor"] and new["executor-rank1"] != old["executor-rank1"], new
    # rank 0 exits on its own once its broadcast fails: the launcher may reap it first
    assert re.search(r"its group lost executor-rank1|executor-rank1 exited with -9 too", tp2.log()), tp2.log()
    assert tp2.metrics()["pagedserve_num_preemptions_total"] > preemptions  # recomputed
    tp2.wait_blocks_free()
