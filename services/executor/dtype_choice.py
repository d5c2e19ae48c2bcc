"""Picks the compute dtype for `--dtype auto`: the fastest one the device really has.

On CUDA: bfloat16, unless the checkpoint says float16. On a CPU: bfloat16 only where
the cores have bfloat16 matrix instructions (AMX or AVX512-BF16), which make its GEMM
several times faster than float32's; elsewhere (AVX2-only, or AVX-512 without BF16)
a bfloat16 GEMM is emulated and runs several times slower than float32, so float32.
The choice and its reason are logged; an explicit dtype is kept as asked, with a
warning where it is the slow one. The KV cache follows the compute dtype unless
`--kv-cache-dtype` names another (`resolve_kv_cache_dtype`).
"""

from __future__ import annotations

import logging

import torch

from kernels.cpu.build import cpu_flags

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")


def choose_dtype(requested: str | torch.dtype, device: str | torch.device = "cpu",
                 checkpoint_dtype: str | torch.dtype | None = None,
                 flags: set[str] | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why) for the request; `flags` are the CPU's (read from /proc/cpuinfo by default)."""
    if isinstance(requested, torch.dtype):
        return requested, "asked for"
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; choose from {['auto', *DTYPES]}")
        return DTYPES[requested], "asked for"
    device_type = torch.device(device).type
    if device_type == "cuda":
        if str(checkpoint_dtype).removeprefix("torch.") == "float16":
            return torch.float16, "CUDA, and the checkpoint is float16"
        return torch.bfloat16, "CUDA"
    if device_type != "cpu":
        return torch.float32, f"{device_type}: float32 is the safe default"
    flags = cpu_flags() if flags is None else flags
    native = [f for f in BF16_MATMUL_FLAGS if f in flags]
    if native:
        return torch.bfloat16, f"CPU has bfloat16 matrix instructions ({', '.join(native)})"
    # ARM cores with the bf16 extension run bfloat16 GEMMs natively too
    if "bf16" in flags and "asimd" in flags:
        return torch.bfloat16, "CPU has ARM bfloat16 instructions (bf16)"
    return torch.float32, "CPU has no bfloat16 matrix instructions (bfloat16 GEMMs would be emulated, several times slower)"


def resolve_dtype(requested: str | torch.dtype, device: str | torch.device = "cpu",
                  checkpoint_dtype: str | torch.dtype | None = None) -> torch.dtype:
    dtype, why = choose_dtype(requested, device, checkpoint_dtype)
    if requested == "auto":
        log.info("dtype auto -> %s: %s", str(dtype).removeprefix("torch."), why)
    elif torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        auto, _ = choose_dtype("auto", device)
        if auto != torch.bfloat16:
            log.warning("dtype bfloat16 on a CPU without bfloat16 matrix instructions: matmuls are emulated and "
                        "slow; --dtype auto would pick %s", str(auto).removeprefix("torch."))
    return dtype


def resolve_kv_cache_dtype(requested: str, dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV cache's dtype: the compute dtype for `auto`, else as asked (e.g. bfloat16 halves a
    float32 pool's memory, so twice the blocks fit). The CPU kernels and the torch reference
    read a cache in another dtype than the activations; the Triton kernels do not."""
    if requested == "auto":
        return dtype
    if requested not in DTYPES:
        raise ValueError(f"unknown KV cache dtype {requested!r}; choose from {['auto', *DTYPES]}")
    kv = DTYPES[requested]
    if kv != dtype and backend == "triton":
        raise ValueError(f"--kv-cache-dtype {requested} with --dtype {str(dtype).removeprefix('torch.')}: the Triton "
                         "kernels need the cache in the compute dtype (use --kv-cache-dtype auto)")
    if kv != dtype:
        log.info("KV cache in %s, compute in %s", requested, str(dtype).removeprefix("torch."))
    return kv
