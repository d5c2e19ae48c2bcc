"""Plain torch paged-attention ops: the executor's CPU path and the oracle for faster kernels.

Layout shared by every backend:
  k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer
  slot              block * block_size + offset, a token's flat position in the pool
  query             [num_tokens, num_heads, head_dim], the new tokens of every sequence
                    of a step laid end to end (query_start_loc[i]..query_start_loc[i+1])
  context_lens[i]   tokens sequence i attends over, its new ones included; its first
                    new token sits at position context_lens[i] - q_len_i
  block_tables      [num_seqs, max_blocks] physical block of each logical block (padded)

Grouped-query attention never copies K/V per query head: in decode, the
num_heads // num_kv_heads query heads sharing a KV head become extra query rows of
it; in longer chunks K/V are expanded as views. Slots beyond a context are masked
out, but must hold finite values (0 * NaN is NaN): the executor zeroes the pool.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def write_kv_to_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their flat slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def copy_blocks(k_caches: list[Tensor], v_caches: list[Tensor], pairs: list[tuple[int, int]] | Tensor) -> None:
    """Copy whole blocks src -> dst in every layer; all sources are read before any write."""
    pairs = torch.as_tensor(pairs, dtype=torch.long).reshape(-1, 2)
    if pairs.numel() == 0:
        return
    src = pairs[:, 0].to(k_caches[0].device)
    dst = pairs[:, 1].to(k_caches[0].device)
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Causal attention of each sequence's new queries over its paged context.

    Sequences with one new token (decode) run together in one masked SDPA call over
    their gathered blocks; longer chunks (prefill, chunked prefill, recompute) run
    one sequence at a time. sliding_window W lets a query at position p see only
    positions > p - W. Returns [num_tokens, num_heads, head_dim].
    """
    head_dim = query.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(ctx_lens))]
    out = torch.empty_like(query)

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = [starts[i] for i in decode]
        out[rows] = _decode_attention(
            query[rows], k_cache, v_cache, block_tables[decode], [ctx_lens[i] for i in decode],
            scale, sliding_window,
        )
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            s = starts[i]
            out[s : s + q_len] = _chunk_attention(
                query[s : s + q_len], k_cache, v_cache, block_tables[i], ctx_lens[i], scale, sliding_window
            )
    return out


def _decode_attention(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, ctx_lens: list[int],
    scale: float, sliding_window: int | None,
) -> Tensor:
    """query [n, num_heads, head_dim], one token per sequence, the last of its context."""
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_ctx = max(ctx_lens)
    tables = block_tables[:, : -(-max_ctx // block_size)]
    # [n, blocks, block_size, kv, d] -> [n, kv, blocks * block_size, d]
    k = k_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)  # a cache in another dtype reads as the query's
    v = v_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)
    pos = torch.arange(k.shape[2], device=query.device)
    ctx = torch.tensor(ctx_lens, device=query.device)[:, None]
    mask = pos < ctx
    if sliding_window is not None:
        mask &= pos > ctx - 1 - sliding_window
    q = query.view(n, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(n, num_heads, head_dim)


def _chunk_attention(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int,
    scale: float, sliding_window: int | None,
) -> Tensor:
    """query [q_len, num_heads, head_dim] at positions ctx_len - q_len .. ctx_len - 1."""
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    blocks = block_table[: -(-ctx_len // block_size)]
    k = k_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1).to(query.dtype)  # [kv, ctx, d]
    v = v_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1).to(query.dtype)
    # [kv, group, q_len, d]; K/V expanded (a view) to match, which keeps SDPA on its fused CPU path
    q = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    k = k[:, None].expand(num_kv_heads, group, ctx_len, head_dim)
    v = v[:, None].expand(num_kv_heads, group, ctx_len, head_dim)
    if q_len == ctx_len and sliding_window is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
        k_pos = torch.arange(ctx_len, device=query.device)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # [kv, group, q_len, d] -> [q_len, num_heads, d]
    return o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


# --- fused elementwise ops of a decoder layer (the CPU extension fuses each into one pass) ---


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x / rms(x), statistics in float32, rounded to x's dtype before the weight (as transformers)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the next norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: Tensor) -> Tensor:
    """silu(gate) * up for x = [gate | up] along the last axis."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_cache(qkv: Tensor, positions: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slot_mapping: Tensor, num_heads: int, num_kv_heads: int, write_kv=None) -> Tensor:
    """Rotary embedding on q and k (halves layout), k and v written at their slots (by `write_kv`,
    a backend's own cache write, or `write_kv_to_cache`); returns q [tokens, heads, head_dim].
    cos_sin [max_pos, head_dim] is float32 holding cos | sin."""
    n, head_dim = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos_sin[positions].to(qkv.dtype)[:, None, :].chunk(2, dim=-1)

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    q = rotate(q.reshape(n, num_heads, head_dim))
    k = rotate(k.reshape(n, num_kv_heads, head_dim))
    (write_kv or write_kv_to_cache)(k, v.reshape(n, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return q


# --- weight-only int8 linear with per-group scales (GGUF Q8_0 layout) ---


def int8_group_linear(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    """x @ w.T in x's dtype for w[n, k] = scales[n, k // 32] * qweight[n, k] (int8), computed in float32."""
    group = qweight.shape[1] // scales.shape[1]
    w = qweight.float() * scales.repeat_interleave(group, dim=1)
    return (x.float() @ w.t()).to(x.dtype)
