"""The paged KV pool: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim].

Its size is either a block count or a memory budget turned into as many blocks as
fit. The pool starts zeroed: attention masks slots beyond a context, and a masked
slot must never hold NaN.
"""

from __future__ import annotations

import torch

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB

def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def blocks_for_memory(memory_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                          head_dim: int, dtype: torch.dtype) -> int:
        return memory_bytes // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in (*self.k_caches, *self.v_caches))
