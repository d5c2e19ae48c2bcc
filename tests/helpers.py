"""Test helpers: build a tiny random Llama, run a whole server as real processes, HTTP calls."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shared.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
IDLE_READINGS_S = 0.4  # wait_blocks_free: longer than the scheduler's heartbeat interval (0.25 s)


def make_tiny_llama(out: Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A 2-layer random Llama with GQA that speaks SmolLM2's tokenizer (vocab 49152); another seed or
    layer count gives another model of the same vocabulary (a draft for speculative decoding)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from shared.model_files import resolve_model

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(resolve_model("smollm2")).save_pretrained(out)
    return out


class ServerProcess:
    """`pagedserve serve` as a real process tree; stopped (and checked) on exit."""

    def __init__(self, model: Path | str, run_dir: Path, extra: list[str], startup_timeout: float = 180,
                 env: dict[str, str] | None = None, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.log_path = run_dir / "server.log"
        self.cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(model),
                    "--port", str(self.port), "--executor-threads", "2", *extra]
        self.startup_timeout = startup_timeout
        self.env = env or {}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # for /health and /metrics
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PAGEDSERVE_RUN_DIR": str(self.run_dir), **self.env}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited at start-up:\n{self.log()}")
            try:
                if get(self.url + "/health", timeout=2, headers=self.headers)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy after {self.startup_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def stage_pid(self, stage: str) -> int:
        """The pid of the ready replica of a stage, from /health."""
        return stage_pid(self.url, stage, self.headers)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(get(self.url + "/metrics", headers=self.headers)[1])

    def wait_blocks_free(self, timeout: float = 10.0) -> dict[str, float]:
        """/metrics once no block is used and nothing runs, in every reading for longer than one
        scheduler heartbeat (0.25 s): a beat sampled before the last request ended also reads 0."""
        deadline = time.monotonic() + timeout
        idle_since = None
        while True:
            m = self.metrics()
            now = time.monotonic()
            if m.get("pagedserve_kv_blocks_used") == 0 and m.get("pagedserve_num_requests_running") == 0:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= IDLE_READINGS_S:
                    return m
            else:
                idle_since = None
            if now > deadline:
                raise AssertionError(f"KV blocks still in use: {m}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def executor_args_from_launcher(argv: list[str]):
    """The executor stage's parsed options, as `pagedserve serve argv` would start it."""
    import argparse

    from services import launcher
    from services.stage_options import add_stage_args
    from shared.config import Addresses

    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    cmd = launcher.stage_commands(parser.parse_args(argv), Addresses.ipc("/tmp/run"))["executor"]
    executor = argparse.ArgumentParser()
    add_stage_args(executor, "executor")
    return executor.parse_args(cmd[cmd.index("executor") + 1 :])


def stage_pid(url: str, stage: str, headers: dict | None = None) -> int:
    status, body = get(url + "/health", headers=headers)
    replicas = [r for r in json.loads(body)["stages"][stage] if r["ready"]]
    assert replicas, f"no ready {stage}: {body}"
    return replicas[0]["pid"]


def get(url: str, timeout: float = 10, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name or name{labels}: value}; unlabelled names sum their series."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        out[name + (labels or "")] = value
        if labels:
            out[name] = out.get(name, 0.0) + value
    return out


def sse_events(raw: str) -> list[dict]:
    events = []
    for block in raw.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            events.append(json.loads(block[len("data: "):]))
    return events
