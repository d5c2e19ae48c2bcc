"""Start a peer as a process group on a free 127.0.0.1 port, wait until it answers, stop it.

pagedserve runs from this interpreter; vLLM from its own venv (setup_vllm.sh); the others
from the peers' venv; all with the model files this venv resolves (`model_files`: the HF
directory `resolve_model` gives and the GGUF beside it), so every peer reads the same weights.
`options` are extra flags for the peer's own launcher (e.g. llama.cpp's `--parallel 64 --split-kv`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("pagedserve", "transformers", "transformers-cb", "llamacpp", "vllm")


def peers_python() -> Path:
    venv = Path(os.environ.get("LOADGEN_PEERS_VENV", ROOT / ".venv-peers"))
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no peers venv at {venv}: run `bash loadgen/peers/setup_venv.sh` first")
    return python


def vllm_python() -> Path | None:
    """The python of a venv with vLLM: $LOADGEN_VLLM_VENV, .venv-vllm, or the peers' venv if it has it."""
    if "LOADGEN_VLLM_VENV" in os.environ:
        candidates = [Path(os.environ["LOADGEN_VLLM_VENV"])]
    else:
        candidates = [ROOT / ".venv-vllm", Path(os.environ.get("LOADGEN_PEERS_VENV", ROOT / ".venv-peers"))]
    for venv in candidates:
        python = venv / "bin" / "python"
        if python.exists() and any((venv / "lib").glob("python3*/site-packages/vllm/__init__.py")):
            return python
    return None


def model_files(model: str) -> tuple[Path, Path | None]:
    """(HF directory, GGUF or None) of pagedserve's `--model`: for `smollm2` or a GGUF file, the
    GGUF and the directory pagedserve converts it into; for a directory (benchmarks/make_1b_model.py
    writes one), itself and the one GGUF inside it, if any (none: llama.cpp cannot serve it)."""
    from shared.model_files import ALIASES, resolve_model, smollm2_gguf_path

    hf = resolve_model(model)
    if model in ALIASES:
        return hf, smollm2_gguf_path()
    path = Path(model).expanduser()
    if path.is_file():
        return hf, path
    ggufs = sorted(path.glob("*.gguf"))
    return hf, ggufs[0] if len(ggufs) == 1 else None


def command(kind: str, port: int, threads: int | None = None, options: tuple[str, ...] = (),
            model: str = "smollm2") -> list[str]:
    """The command line; `threads` sets every server's compute threads alike (default: its own);
    every server serves `model` (pagedserve's `--model`; the others its files, `model_files`)."""
    from shared.model_files import default_served_name

    extra = [] if threads is None else [f"--{'executor-threads' if kind == 'pagedserve' else 'threads'}", str(threads)]
    extra += list(options)
    if kind == "pagedserve":
        return [sys.executable, "-m", "services.cli", "serve", "--model", model, "--port", str(port), *extra]
    if kind not in KINDS:
        raise ValueError(f"unknown peer {kind!r}; choose from {', '.join(KINDS)}")
    hf, gguf = model_files(model)
    name = ["--served-model-name" if kind == "vllm" else "--alias", default_served_name(model)]
    if kind == "vllm":
        python = vllm_python()
        if python is None:
            raise SystemExit("no venv with vLLM: run `bash loadgen/peers/setup_vllm.sh` first")
        return [str(python), "-m", "loadgen.peers.vllm_server", "--port", str(port), "--model-dir", str(hf),
                *name, *extra]
    if kind in ("transformers", "transformers-cb"):
        cmd = [str(peers_python()), "-m", "loadgen.peers.transformers_serve", "--port", str(port),
               "--model-dir", str(hf)]
        return cmd + (["--continuous-batching"] if kind == "transformers-cb" else []) + extra
    if gguf is None:
        raise SystemExit(f"llama.cpp needs a GGUF: none (or several) in {model}")
    return [str(peers_python()), "-m", "loadgen.peers.llamacpp_server", "--port", str(port), "--gguf", str(gguf),
            *name, *extra]


class Peer:
    """`with Peer("llamacpp", log_dir) as peer:` ... `peer.url`."""

    def __init__(self, kind: str, log_dir: Path, port: int | None = None, threads: int | None = None,
                 startup_timeout: float = 300.0, options: tuple[str, ...] = (), model: str = "smollm2",
                 log_name: str | None = None, env: dict[str, str] | None = None) -> None:
        self.kind = kind
        self.extra_env = env or {}  # on top of this process's environment
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = command(kind, self.port, threads, options, model)
        self.log_path = Path(log_dir) / f"peer-{log_name or kind}.log"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Peer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        env = {**os.environ, **self.extra_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer {self.kind} exited at start-up; see {self.log_path}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    healthy = resp.status == 200
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                    if healthy and resp.status == 200 and json.load(resp).get("data"):
                        return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"peer {self.kind} not ready after {self.startup_timeout:g}s; see {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
