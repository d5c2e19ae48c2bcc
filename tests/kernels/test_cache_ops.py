"""write_kv_to_cache and copy_blocks (Triton) against the torch reference: exact, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.cache_ops import copy_blocks, write_kv_to_cache  # noqa: E402
from tests.kernels.paged_batch import DEVICE, param_id, runnable  # noqa: E402

pytestmark = runnable


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,dtype", [
    (8, 2, 64, torch.float16), (16, 3, 128, torch.bfloat16), (32, 1, 64, torch.bfloat16),
], ids=param_id)
def test_write_kv_to_cache(block_size, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 9
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # key and value as the model has them: views into one fused projection, rows far apart
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    # scattered slots: the end of block 5, the start of block 1, the last slot of the pool
    last = num_blocks * block_size - 1
    slots = torch.tensor([5 * block_size + 1, 5 * block_size + 2, block_size, block_size + 1, 0, last, 3, 4, 17])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_to_cache(key, value, expected_k, expected_v, slots)
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv_to_cache(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), expected_k) and torch.equal(v_dev.cpu(), expected_v)


def test_negative_slots_write_nothing():
    k_cache = torch.zeros(4, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    write_kv_to_cache(key, -key, k_cache, v_cache, torch.tensor([9, -1, -1], device=DEVICE))
    assert torch.equal(k_cache.view(32, -1)[9], key[0].flatten())
    assert torch.equal(v_cache.view(32, -1)[9], -key[0].flatten())
    k_cache.view(32, -1)[9] = 0
    v_cache.view(32, -1)[9] = 0
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("pairs", [
    [(1, 4), (2, 5), (4, 0)],  # block 4 is read before it is overwritten
    [(0, 3), (2, 1)],  # no block both read and written
    [(5, 2)],
], ids=["overlapping", "disjoint", "single"])
def test_copy_blocks(pairs):
    gen = torch.Generator().manual_seed(1)
    k_caches = [torch.randn(6, 16, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    v_caches = [torch.randn(6, 16, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(3)]
    expected_k, expected_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    reference.copy_blocks(expected_k, expected_v, pairs)
    k_dev, v_dev = [c.to(DEVICE) for c in k_caches], [c.to(DEVICE) for c in v_caches]
    copy_blocks(k_dev, v_dev, pairs)
    for got, want in zip(k_dev + v_dev, expected_k + expected_v, strict=True):
        assert torch.equal(got.cpu(), want)
    copy_blocks(k_dev, v_dev, [])  # nothing to copy: no launch, no error
