"""Paged decode attention in Triton: one new query token per sequence, long contexts split across programs.

Grid (num_seqs, num_kv_heads, num_splits). A program takes one KV head together with
every query head that shares it (GQA: each K/V tile is loaded once for the whole
group, the group's heads being the rows of the dot) over one partition of the
context, walking the block table tile by tile with an online softmax. With one
partition it writes the output directly; with several, each writes its partial
(running max, sum of weights, normalised output) and a second kernel merges a head's
partitions (split-K, as in flash-decoding), so a few long sequences still fill the GPU.

The number of partitions follows from shapes alone (the block table's width), never
from context lengths on the device, so a call needs no host sync and can be captured
in a CUDA graph; partitions past a sequence's context return at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import dot, dot_size, dots_in_fp32, next_pow2, num_sms

LOG2E = 1.4426950408889634
TILE = 64  # context tokens per inner step (several KV blocks when blocks are small)
MIN_PARTITION = 256  # below this a partition is too short to pay for its merge
MAX_PARTITION = 2048


@triton.jit
def _decode_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    qk_scale, window, num_splits,
    stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_os, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PARTITION: tl.constexpr,
    USE_WINDOW: tl.constexpr, SINGLE_SPLIT: tl.constexpr, FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    ctx = tl.load(context_lens_ptr + seq)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(ctx - window, 0)  # the query (position ctx - 1) sees positions >= ctx - window
    part_start = split * PARTITION
    part_end = tl.minimum(part_start + PARTITION, ctx)
    if part_start >= ctx or part_end <= first:
        return

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    # the first tile holds `first` or starts the partition, so every tile has a visible token
    # and the running max is finite from the first tile on
    lo = tl.maximum(part_start, first // TILE * TILE)
    table = block_tables_ptr + seq * stride_bt
    for tile_start in range(lo, part_end, TILE):
        pos = tile_start + offs_t
        in_ctx = pos < part_end
        visible = in_ctx
        if USE_WINDOW:
            visible = visible & (pos >= first)
        block = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = in_ctx[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), FP32) * qk_scale  # [GROUP_PAD, TILE], log2 domain
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p, v, FP32)
        m_i = m_new

    out = acc / l_i[:, None]
    if SINGLE_SPLIT:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (seq * num_heads + heads) * num_splits + split  # [num_seqs, num_heads, num_splits]
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], out, mask=g_mask[:, None])


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr,
    window, num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PARTITION: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    """One (sequence, head): weights each partition's output by its share of the softmax mass."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    first_split = 0
    if USE_WINDOW:
        first_split = tl.maximum(ctx - window, 0) // PARTITION
    last_split = tl.cdiv(ctx, PARTITION)
    base = (seq * tl.num_programs(1) + head) * num_splits
    offs_d = tl.arange(0, HEAD_PAD)

    m = tl.full([], float("-inf"), tl.float32)
    for s in range(first_split, last_split):
        m = tl.maximum(m, tl.load(part_max_ptr + base + s))
    acc = tl.zeros([HEAD_PAD], tl.float32)
    total = tl.zeros([], tl.float32)
    for s in range(first_split, last_split):
        w = tl.exp2(tl.load(part_max_ptr + base + s) - m) * tl.load(part_sum_ptr + base + s)
        acc += w * tl.load(part_out_ptr + (base + s) * HEAD_PAD + offs_d)
        total += w
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def partition_size(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Tokens per partition: enough partitions that the grid has several programs per SM."""
    target_programs = 8 * num_sms(device)
    splits = -(-target_programs // max(num_seqs * num_kv_heads, 1))
    size = next_pow2(-(-max_context // splits))
    return min(max(size, MIN_PARTITION), MAX_PARTITION)


def paged_attention_decode(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
    partition: int | None = None,
) -> Tensor:
    """query [num_seqs, num_heads, head_dim], each the last token of its context; layout as in
    `kernels.reference`. partition (tokens per split, a power of two >= 16) defaults to a size
    that fills the GPU. Returns [num_seqs, num_heads, head_dim] in query's dtype."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    max_context = block_tables.shape[1] * block_size
    if partition is None:
        partition = partition_size(num_seqs, num_kv_heads, max_context, query.device)
    tile = min(TILE, partition)
    num_splits = -(-max_context // partition)
    head_pad = dot_size(head_dim)
    single = num_splits == 1
    if single:
        part_out = part_max = part_sum = out  # unused
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_pad, dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    window = sliding_window or 0
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_max, part_sum,
        query, k_cache, v_cache, block_tables, context_lens,
        scale * LOG2E, window, num_splits,
        query.stride(0), query.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=dot_size(group), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE=tile, PARTITION=partition,
        USE_WINDOW=bool(sliding_window), SINGLE_SPLIT=single, FP32=dots_in_fp32(_decode_kernel, k_cache.dtype),
    )
    if not single:
        _merge_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, context_lens, window, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, PARTITION=partition, USE_WINDOW=bool(sliding_window),
        )
    return out
