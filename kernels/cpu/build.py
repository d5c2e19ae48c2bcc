"""Builds and loads the C++ CPU kernels with torch's extension tooling, once per machine.

`load()` compiles `csrc/*.cpp` with `torch.utils.cpp_extension.load` (ninja) for this
CPU's own instruction set (-march=native) into the pagedserve cache, named by a hash
of the sources, the torch version and the CPU's ISA flags, so a cache carried to a
different machine rebuilds instead of dying on an illegal instruction. A failed build
logs a warning and returns None: callers fall back to the torch reference.
`PAGEDSERVE_CPU_MARCH` (e.g. `haswell`) builds for an older instruction set than this
CPU's, which is how tests exercise the AVX2 paths on an AVX-512 machine.

    python -m kernels.cpu.build     # what `make install` runs: build now, print where
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
             "amx_bf16", "amx_tile", "avx_vnni", "asimd", "sve", "bf16")
DISABLE_ENV = "PAGEDSERVE_DISABLE_CPU_KERNELS"
MARCH_ENV = "PAGEDSERVE_CPU_MARCH"


def march() -> str:
    return os.environ.get(MARCH_ENV) or "native"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def extension_name() -> str:
    h = hashlib.sha256()
    for src in sorted(CSRC.iterdir()):
        h.update(src.name.encode() + src.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(sorted(cpu_flags() & set(ISA_FLAGS))).encode())
    h.update(march().encode())
    return f"pagedserve_cpu_{h.hexdigest()[:12]}"


def build_dir() -> Path:
    from shared.model_files import cache_root

    return cache_root() / "extensions"


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, building them if this machine has none yet; None if that fails."""
    if os.environ.get(DISABLE_ENV):
        log.warning("CPU kernels disabled by %s: attention runs on the torch reference", DISABLE_ENV)
        return None
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        directory = build_dir() / name
        built = _load_built(name, directory / f"{name}.so")
        if built is not None:
            return built
        directory.mkdir(parents=True, exist_ok=True)
        flags = ["-O3", "-fopenmp", f"-march={march()}"]
        return cpp_extension.load(
            name=name,
            sources=sorted(str(p) for p in CSRC.glob("*.cpp")),
            extra_include_paths=[str(CSRC)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # a missing compiler, ninja or header must not take the executor down
        log.warning("CPU kernels unavailable (%s: %s); attention runs on the torch reference",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def _load_built(name: str, so: Path) -> ModuleType | None:
    """The extension built before under this name, loaded as it is. The name hashes the
    sources, torch and the ISA, so any checkout may use it; going through ninja again would
    rebuild it whenever another checkout's paths or mtimes differ (worktrees clobbered one
    build directory that way, and a build killed midway left executors waiting on its lock)."""
    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as exc:  # a half-written file: build it again
        log.warning("cannot load %s (%s); rebuilding it", so, exc)
        return None


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    if module is None:
        print("CPU kernels: build failed, the torch reference will be used", file=sys.stderr)
        return 0  # the engine still works; serving says so in its log
    print(f"CPU kernels: {module.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
