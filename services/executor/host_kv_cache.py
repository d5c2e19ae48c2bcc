"""The executor's host KV cache (the swap space of `--swap-space`): the KV of preempted
sequences in host memory, and the block moves.

One K and one V tensor per layer, shaped like the device pool, in host memory
(pinned on CUDA, so copies can overlap). The scheduler decides which device block
goes to which host block and back (`services/scheduler/host_block_pool.py`); this only
copies.
"""

from __future__ import annotations

import torch

from services.executor.kv_cache import KVCache, bytes_per_block


class HostKVCache:
    def __init__(self, pool: KVCache, memory_bytes: int):
        k0 = pool.k_caches[0]
        num_layers = len(pool.k_caches)
        self.num_blocks = memory_bytes // bytes_per_block(num_layers, *k0.shape[1:], k0.dtype)
        pin = k0.device.type == "cuda"
        shape = (self.num_blocks, *k0.shape[1:])
        self.k = [torch.zeros(shape, dtype=k0.dtype, pin_memory=pin) for _ in range(num_layers if self.num_blocks else 0)]
        self.v = [torch.zeros(shape, dtype=k0.dtype, pin_memory=pin) for _ in range(num_layers if self.num_blocks else 0)]
        self.pool = pool

    def _check(self, pairs: list[tuple[int, int]], device_first: bool) -> None:
        for a, b in pairs:
            dev, host = (a, b) if device_first else (b, a)
            if not (0 <= dev < self.pool.num_blocks and 0 <= host < self.num_blocks):
                raise ValueError(f"swap pair {(a, b)} outside the pool or the swap space")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) copies to host memory."""
        if not pairs:
            return
        self._check(pairs, device_first=True)
        dev = torch.tensor([d for d, _ in pairs], device=self.pool.k_caches[0].device)
        host = torch.tensor([h for _, h in pairs])
        for pool_layers, host_layers in ((self.pool.k_caches, self.k), (self.pool.v_caches, self.v)):
            for layer, host_layer in zip(pool_layers, host_layers, strict=True):
                host_layer[host] = layer[dev].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) copies back into the pool."""
        if not pairs:
            return
        self._check(pairs, device_first=False)
        host = torch.tensor([h for h, _ in pairs])
        device = self.pool.k_caches[0].device
        dev = torch.tensor([d for _, d in pairs], device=device)
        for pool_layers, host_layers in ((self.pool.k_caches, self.k), (self.pool.v_caches, self.v)):
            for layer, host_layer in zip(pool_layers, host_layers, strict=True):
                layer[dev] = host_layer[host].to(device, non_blocking=True)
