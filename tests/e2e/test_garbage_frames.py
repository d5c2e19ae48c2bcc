"""Garbage frames to the stages that connect (a tokenizer replica, the executor), each run
alone as a real process against sockets this test binds in the place of its peers: the
stage logs and drops every bad frame and then still does its job. (The binding stages,
gateway and scheduler, get theirs in test_recovery.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from shared.config import Addresses
from shared.messages import (
    ExecuteStep,
    ExecutorReady,
    ExecutorToScheduler,
    GatewayToTokenizer,
    GenerateRequest,
    Heartbeat,
    SamplingParams,
    ScheduledSeq,
    SchedulerHello,
    SchedulerToExecutor,
    SeqSampling,
    StatusToGateway,
    StepResult,
    TokenizedRequest,
    TokenizerToGateway,
)
from shared.transport import PullSocket, PushSocket, RouterSocket
from tests.helpers import ROOT

GARBAGE = [b"", b"\xc1", os.urandom(48), msgspec.msgpack.encode({"type": "ExecuteStep", "step_id": "x"}),
           msgspec.msgpack.encode(Heartbeat("x", "x", 1, "ready", 0.0))]  # the last: a real message, wrong socket


TOKENIZER = b"garbage-tokenizer"  # the replica's name: the gateway routes to it by name


def to_tokenizer(router: RouterSocket, frame: bytes, timeout: float = 10.0) -> None:
    """Send a raw frame to the replica, once its connection is up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            router.sock.send_multipart([TOKENIZER, frame], zmq.NOBLOCK)
            return
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the tokenizer never connected to tokenizer_in"
            time.sleep(0.02)


def start_stage(name: str, model, addrs: Addresses, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "stage", name, "--model", str(model), *addrs.as_argv()]
    if name == "executor":
        cmd += ["--dtype", "float32", "--threads", "1"]
    if name == "tokenizer":
        cmd += ["--replica", TOKENIZER.decode()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def receive(sock, kind, timeout=60.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for item in sock.recv_nowait():
            msg = item[1] if isinstance(item, tuple) else item
            if isinstance(msg, kind):
                return item
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the stage exited with {proc.returncode}")
        time.sleep(0.02)
    raise AssertionError(f"no {kind.__name__} within {timeout} s")


@pytest.fixture()
def stages(tiny_model_dir, tmp_path):
    """A tokenizer and an executor, started together (their imports overlap)."""
    ctx = zmq.Context()
    tok_addrs = Addresses.ipc(str(tmp_path / "t"))
    exe_addrs = Addresses.ipc(str(tmp_path / "e"))
    (tmp_path / "t").mkdir()
    (tmp_path / "e").mkdir()
    peers = {
        "to_tokenizer": RouterSocket(ctx, tok_addrs.tokenizer_in, GatewayToTokenizer, GatewayToTokenizer),
        "from_tokenizer": PullSocket(ctx, tok_addrs.gateway_in, TokenizerToGateway, bind=True),
        "status": PullSocket(ctx, tok_addrs.status, StatusToGateway, bind=True),
        "steps": PushSocket(ctx, exe_addrs.executor_in, SchedulerToExecutor, bind=True),
        "results": PullSocket(ctx, exe_addrs.executor_out, ExecutorToScheduler, bind=True),
    }
    procs = {
        "tokenizer": start_stage("tokenizer", tiny_model_dir, tok_addrs, tmp_path / "tokenizer.log"),
        "executor": start_stage("executor", tiny_model_dir, exe_addrs, tmp_path / "executor.log"),
    }
    yield peers, procs, tmp_path
    for proc in procs.values():
        proc.terminate()
        proc.wait(15)
    ctx.destroy(linger=0)


def test_tokenizer_and_executor_drop_garbage_and_keep_working(stages):
    peers, procs, tmp_path = stages

    # executor: announces itself, survives garbage, answers a hello, runs a step
    ready = receive(peers["results"], ExecutorReady, proc=procs["executor"])
    for junk in GARBAGE:
        peers["steps"].sock.send(junk)
    peers["steps"].send(SchedulerHello("new-scheduler"))
    again = receive(peers["results"], ExecutorReady, proc=procs["executor"])
    assert again.instance == ready.instance and again.num_kv_blocks == ready.num_kv_blocks
    seq = ScheduledSeq("r1", [5, 6, 7], 0, [0], [0, 1, 2], True, 0, SeqSampling(0.0, 1.0, 0, None))
    peers["steps"].send(ExecuteStep(step_id=7, seqs=[seq]))
    result = receive(peers["results"], StepResult, proc=procs["executor"])
    assert result.step_id == 7 and len(result.sampled) == 1 and 0 <= result.sampled[0] < 49152

    # tokenizer (its one socket in: tokenizer_in): after garbage, it still answers requests
    while not any(b.state == "ready" for b in peers["status"].recv_nowait()):
        assert procs["tokenizer"].poll() is None
        time.sleep(0.05)
    for rid in ("g1", "g2"):
        for junk in GARBAGE:
            to_tokenizer(peers["to_tokenizer"], junk)
        to_tokenizer(peers["to_tokenizer"], msgspec.msgpack.encode(
            GenerateRequest(rid, SamplingParams(max_tokens=2), prompt_token_ids=[5, 6, 7])))
        tokenized = receive(peers["from_tokenizer"], TokenizedRequest, proc=procs["tokenizer"])
        assert tokenized.request_id == rid and tokenized.prompt_token_ids == [5, 6, 7]

    for name, proc in procs.items():
        assert proc.poll() is None, name
        log = (tmp_path / f"{name}.log").read_text()
        assert log.count("dropped malformed frame") >= len(GARBAGE), log[-3000:]
