"""KV pool writes in Triton: new tokens' K/V into their slots, and the scheduler's copy-on-write block copies.

Same signatures and layout as `kernels.reference`. One difference: a negative slot
means "no token here" and is skipped, so a CUDA-graph batch padded to a captured
size can write nothing for its padding rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import next_pow2

COPY_CHUNK = 4096  # elements of a block one copy program moves


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, pairs_ptr, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    x = tl.load(src_ptr + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(dst_ptr + dst * BLOCK_NUMEL + offs, x, mask=mask)


def write_kv_to_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their flat slots (negative: skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_PAD=next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


def _copy(src: Tensor, dst: Tensor, pairs: Tensor) -> None:
    block_numel = src[0].numel()
    chunk = min(COPY_CHUNK, next_pow2(block_numel))
    _copy_blocks_kernel[(pairs.shape[0], triton.cdiv(block_numel, chunk))](
        src, dst, pairs, BLOCK_NUMEL=block_numel, CHUNK=chunk,
    )


def copy_blocks(k_caches: list[Tensor], v_caches: list[Tensor], pairs: list[tuple[int, int]] | Tensor) -> None:
    """Copy whole blocks src -> dst in every layer; all sources are read before any write."""
    pairs = torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)
    if pairs.numel() == 0:
        return
    device = k_caches[0].device
    n = pairs.shape[0]
    # a block that is both read and written needs its old contents staged first
    overlap = bool(set(pairs[:, 0].tolist()) & set(pairs[:, 1].tolist()))
    rows = torch.arange(n, dtype=torch.long)
    gather = torch.stack([pairs[:, 0], rows], 1).contiguous().to(device)
    scatter = torch.stack([rows, pairs[:, 1]], 1).contiguous().to(device)
    direct = pairs.contiguous().to(device)
    for cache in (*k_caches, *v_caches):
        if not cache.is_contiguous():
            raise ValueError("copy_blocks needs contiguous caches")
        if overlap:
            staged = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=device)
            _copy(cache, staged, gather)
            _copy(staged, cache, scatter)
        else:
            _copy(cache, cache, direct)
