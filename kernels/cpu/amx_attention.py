"""The AMX chunk attention kernel's entry and its plain torch reference.

`csrc/amx_attention.cpp` computes causal attention of one long bfloat16 chunk (head_dim 64)
over its paged context on AMX tiles; `kernels.cpu.dense_attention` sends it the long chunks
of a step where `available()` says it runs. `reference` is the same computation in float32
through `kernels.reference.paged_attention`, what the tests compare the kernel with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import reference as torch_reference


def available(ext) -> bool:
    """Whether the built extension has the kernel and Linux granted this process the tile registers."""
    return ext is not None and bool(ext.amx_attention())


def chunk_attention(ext, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int,
                    scale: float, sliding_window: int = 0) -> Tensor:
    """query [q_len, heads, 64] bfloat16 at positions ctx_len - q_len .. ctx_len - 1 over its paged
    context (block_table: the sequence's block ids); returns [q_len, heads, 64]."""
    out = torch.empty(query.shape, dtype=query.dtype)
    ext.amx_chunk_attention(out, query, k_cache, v_cache, block_table, ctx_len, scale, sliding_window)
    return out


def reference(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int, scale: float,
              sliding_window: int = 0) -> Tensor:
    """The same attention in float32 (inputs as they are, upcast), [q_len, heads, 64] float32."""
    q_len = query.shape[0]
    return torch_reference.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), block_table[None].long(),
        torch.tensor([0, q_len]), torch.tensor([ctx_len]), scale=scale, sliding_window=sliding_window or None)
