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


def q4_pack(codes: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 codes [N, K] (0..15) with scale and min [N, K/32] in the CPU kernel's layout:
    (packed uint8 [N*K/2], d [N/16, K/32, 16], m [N/16, K/32, 16]); N a multiple of 16.
    Lane l of block b is output row 16b + l; within a group, byte j of chunk h holds input
    h*4 + j (low nibble) and (h+4)*4 + j (high nibble)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n // 16, 16, k // 32, 2, 4, 4)  # block, lane, group, nibble, h, byte
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # block, group, h, lane, byte
    d = scale.float().view(n // 16, 16, k // 32).transpose(1, 2)
    m = low.float().view(n // 16, 16, k // 32).transpose(1, 2)
    return packed.contiguous().view(-1), d.contiguous(), m.contiguous()


def q4_unpack(packed: Tensor, n: int, k: int) -> Tensor:
    """The codes [N, K] that `q4_pack` packed."""
    p = packed.view(n // 16, k // 32, 4, 16, 4).permute(0, 3, 1, 2, 4)  # block, lane, group, h, byte
    return torch.stack([p & 0x0F, p >> 4], dim=3).reshape(n, k)


def q8_pack(codes: Tensor, scale: Tensor, low: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """8-bit codes [N, K] (0..255) with scale and min [N, K/32] in the CPU kernel's layout:
    (packed uint8 [N*K], d and m as q4_pack's); within a group, chunk h (0..7) holds inputs h*4..h*4+3
    of the block's 16 rows, 4 bytes a row."""
    n, k = codes.shape
    packed = codes.to(torch.uint8).view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # block, group, h, lane, byte
    d = scale.float().view(n // 16, 16, k // 32).transpose(1, 2)
    m = low.float().view(n // 16, 16, k // 32).transpose(1, 2)
    return packed.contiguous().view(-1), d.contiguous(), m.contiguous()


def q8_unpack(packed: Tensor, n: int, k: int) -> Tensor:
    """The codes [N, K] that `q8_pack` packed."""
    return packed.view(n // 16, k // 32, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(n, k)


def quantize_rows_q8(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [M, K] per group of 32 as (int8 codes [M, K] as float, dx [M, K/32], dx * sum of codes [M, K/32])."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(g * inv)
    dx = (amax / 127.0).squeeze(-1)
    return codes.view_as(x), dx, dx * codes.sum(-1)


def q4_linear(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor) -> Tensor:
    """x @ w.T in x's dtype for the packed Q4_1 weight w = d * c + m, with x quantized to int8 per
    group of 32 first (the CPU kernel's arithmetic: integer dot products per group, scaled once)."""
    blocks, groups, lanes = d.shape
    return _coded_linear(x, q4_unpack(packed, blocks * lanes, groups * 32), d, mn).to(x.dtype)


def q4_dequantize(packed: Tensor, d: Tensor, mn: Tensor) -> Tensor:
    """The bfloat16 weight [N, K] of a packed Q4_1 weight: d * code + m in float32, rounded once."""
    blocks, groups, lanes = d.shape
    n, k = blocks * lanes, groups * 32
    codes = q4_unpack(packed, n, k).float().view(n, groups, 32)
    scale = d.float().transpose(1, 2).reshape(n, groups, 1)
    low = mn.float().transpose(1, 2).reshape(n, groups, 1)
    return torch.addcmul(low, codes, scale).view(n, k).bfloat16()


def q4_linear_tiles(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor) -> Tensor:
    """What the CPU kernel of that name computes: bfloat16 x @ q4_dequantize(...).T summed in float32
    (here in float64, so the kernel differs by its float32 rounding), rounded to x's dtype."""
    return (x.double() @ q4_dequantize(packed, d, mn).double().t()).float().to(x.dtype)


def q4_gate_up_silu_tiles(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor) -> Tensor:
    """What the CPU kernel of that name computes: q4_linear_tiles of a gate/up weight (the gate's rows,
    then the up's), then silu_and_mul."""
    return silu_and_mul(q4_linear_tiles(x, packed, d, mn))


def q8_dequantize(packed: Tensor, d: Tensor, mn: Tensor) -> Tensor:
    """The bfloat16 weight [N, K] of packed 8-bit codes (`q8_pack`; an empty mn: Q8_0's -128 d)."""
    blocks, groups, lanes = d.shape
    n, k = blocks * lanes, groups * 32
    if mn.numel() == 0:
        mn = -128 * d
    codes = q8_unpack(packed, n, k).float().view(n, groups, 32)
    scale = d.float().transpose(1, 2).reshape(n, groups, 1)
    low = mn.float().transpose(1, 2).reshape(n, groups, 1)
    return torch.addcmul(low, codes, scale).view(n, k).bfloat16()


def q8_linear_tiles(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor, out: Tensor | None = None) -> Tensor:
    """q4_linear_tiles for 8-bit codes: bfloat16 x @ q8_dequantize(...).T summed in float64; into out
    (float32, or x's dtype) when given."""
    y = (x.double() @ q8_dequantize(packed, d, mn).double().t()).float()
    return y.to(x.dtype) if out is None else out.copy_(y)


def pack_tiles(weight: Tensor) -> Tensor:
    """A bfloat16 weight [N, K] (N a multiple of 16, K of 32) in the AMX tile unit's pair-row layout, as
    bf16_linear_tiles reads it: int32 [N/16, K/32, 16, 16], element [b, g, p, l] holding the pair
    (w[16b + l, 32g + 2p], w[16b + l, 32g + 2p + 1]), each 16 x 16 slice one B tile."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 16 or k % 32:
        raise ValueError(f"pack_tiles takes a bfloat16 [N, K] weight with N % 16 == 0 and K % 32 == 0, "
                         f"not {weight.dtype} {tuple(weight.shape)}")
    tiles = weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return tiles.view(torch.int32).view(n // 16, k // 32, 16, 16)


def unpack_tiles(packed: Tensor) -> Tensor:
    """pack_tiles' inverse: the bfloat16 weight [N, K]."""
    blocks, groups = packed.shape[:2]
    pairs = packed.contiguous().view(torch.bfloat16).view(blocks, groups, 16, 16, 2)
    return pairs.permute(0, 3, 1, 2, 4).reshape(blocks * 16, groups * 32)


def bf16_linear_tiles(x: Tensor, packed: Tensor, out: Tensor | None = None) -> Tensor:
    """What the CPU kernel of that name computes: bfloat16 x @ unpack_tiles(packed).T summed in float32
    (here in float64, so the kernel differs by its float32 rounding); into out (float32 or bfloat16)."""
    y = (x.double() @ unpack_tiles(packed).double().t()).float()
    return y.to(x.dtype) if out is None else out.copy_(y)


def bf16_gate_up_silu_tiles(x: Tensor, packed: Tensor) -> Tensor:
    """What the CPU kernel of that name computes: bf16_linear_tiles of a gate/up weight, then silu_and_mul."""
    return silu_and_mul(bf16_linear_tiles(x, packed))


def q8_linear(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor, out: Tensor | None = None) -> Tensor:
    """q4_linear for 8-bit codes (`q8_pack`); into out (float32, or x's dtype) when given. An empty
    mn stands for Q8_0's -128 d (codes c + 128 of w = d * c)."""
    blocks, groups, lanes = d.shape
    if mn.numel() == 0:
        mn = -128 * d
    y = _coded_linear(x, q8_unpack(packed, blocks * lanes, groups * 32), d, mn)
    return y.to(x.dtype) if out is None else out.copy_(y)


def _coded_linear(x: Tensor, codes: Tensor, d: Tensor, mn: Tensor) -> Tensor:
    """x @ (d * codes + m).T in float32, x quantized to int8 per group of 32 as the kernels do."""
    blocks, groups, lanes = d.shape
    n = blocks * lanes
    c = codes.double().view(n, groups, 32)
    cx, dx, sx = quantize_rows_q8(x)
    dots = torch.einsum("ngk,mgk->mng", c, cx.double().view(x.shape[0], groups, 32))
    dn = d.double().transpose(1, 2).reshape(n, groups)
    mn_ = mn.double().transpose(1, 2).reshape(n, groups)
    y = (dots * dn[None] * dx.double()[:, None]).sum(-1) + (mn_[None] * sx.double()[:, None]).sum(-1)
    return y.float()
