"""The chunk attention kernels' entries and their plain torch reference.

Two C++ kernels compute causal attention of one long bfloat16 chunk (head_dim 64) over its
paged context: `amx` on AMX tiles (csrc/amx_attention.cpp) and `avx512_bf16` with AVX512-BF16
dot products (csrc/avx512_attention.cpp, for CPUs with those but no tiles: AMD Zen 4, Intel
Cooper Lake). `kernels.cpu.dense_attention` sends them the long chunks of a step;
`best(ext)` names the one that runs here, AMX first. `reference` is the same computation in
float32 through `kernels.reference.paged_attention`, what the tests compare them with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import reference as torch_reference

# name: (the extension's "does it run here" function, the kernel), fastest first
KERNELS = {"amx": ("amx_attention", "amx_chunk_attention"),
           "avx512_bf16": ("avx512_bf16_attention", "avx512_bf16_chunk_attention")}


def available(ext, name: str) -> bool:
    """Whether the built extension has kernel `name` and it runs here (AMX: Linux granted the tile registers)."""
    return ext is not None and bool(getattr(ext, KERNELS[name][0])())


def best(ext) -> str | None:
    """The fastest chunk kernel that runs here, or None."""
    return next((name for name in KERNELS if available(ext, name)), None)


def kernel(ext, name: str) -> Callable:
    """The kernel itself: (out, query, k_cache, v_cache, block_table, ctx_len, scale, sliding_window)."""
    return getattr(ext, KERNELS[name][1])


def chunk_attention(ext, name: str, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                    ctx_len: int, scale: float, sliding_window: int = 0) -> Tensor:
    """query [q_len, heads, 64] bfloat16 at positions ctx_len - q_len .. ctx_len - 1 over its paged
    context (block_table: the sequence's block ids), through kernel `name`; returns [q_len, heads, 64]."""
    out = torch.empty(query.shape, dtype=query.dtype)
    kernel(ext, name)(out, query, k_cache, v_cache, block_table, ctx_len, scale, sliding_window)
    return out


def reference(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int, scale: float,
              sliding_window: int = 0) -> Tensor:
    """The same attention in float32 (inputs as they are, upcast), [q_len, heads, 64] float32."""
    q_len = query.shape[0]
    return torch_reference.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), block_table[None].long(),
        torch.tensor([0, q_len]), torch.tensor([ctx_len]), scale=scale, sliding_window=sliding_window or None)
