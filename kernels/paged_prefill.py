"""Paged prefill attention in Triton: each sequence's chunk of new tokens, causally over its paged context.

The context may already hold earlier tokens (a prefix-cache hit, chunked prefill,
recompute after preemption): a chunk of q_len tokens sits at positions
context_len - q_len .. context_len - 1 and sees every earlier position.

Grid (query tiles, num_kv_heads). A tile is BLOCK_Q consecutive tokens of one sequence
times the query heads sharing one KV head, laid out as the BLOCK_Q * GROUP_PAD rows
of one dot, so each K/V tile read from the pool serves the whole group. Tiles are
numbered without a host sync: sequence s owns tiles from query_start_loc[s] // BLOCK_Q + s
on, an upper bound of num_tokens // BLOCK_Q + num_seqs tiles in all, and a program
finds its sequence by binary search; spare tile numbers return at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_utils import dot, dot_size, dots_in_fp32

LOG2E = 1.4426950408889634
ROWS = 64  # query rows (tokens x heads of a group) per program
TILE = 32  # context tokens per inner step


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence s with query_start_loc[s] // BLOCK_Q + s <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    qk_scale, window, num_seqs,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr, FP32: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # the tile's first token in the chunk
    if first_tok >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)
    chunk_pos = ctx - q_len  # position of the chunk's first token

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = first_tok + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_mask = (tok < q_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = chunk_pos + tok

    kv_end = tl.minimum(chunk_pos + first_tok + BLOCK_Q, ctx)  # the tile's last query sees up to here
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(chunk_pos + first_tok - window + 1, 0) // TILE * TILE
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile_start in range(lo, kv_end, TILE):
        pos = tile_start + offs_t
        in_ctx = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = in_ctx[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), FP32) * qk_scale  # log2 domain
        visible = pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # a row may see nothing in a tile (window, or a row past the chunk): keep its sums at zero
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p, v, FP32)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Arguments and result as `kernels.reference.paged_attention` (any mix of chunk lengths)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(ROWS // group_pad, 1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        scale * LOG2E, sliding_window or 0, num_seqs,
        query.stride(0), query.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_PAD=dot_size(head_dim),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, TILE=TILE,
        USE_WINDOW=bool(sliding_window), FP32=dots_in_fp32(_prefill_kernel, k_cache.dtype),
    )
    return out
