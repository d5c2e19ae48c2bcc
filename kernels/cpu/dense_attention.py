"""Long query chunks through a chunk kernel or torch's fused SDPA instead of the C++ paged kernel.

Where the CPU has AMX tiles or AVX512-BF16 (and the chunk is bfloat16 with head_dim 64) the long
chunks go to a chunk kernel (`kernels.cpu.chunk_kernels`: csrc/amx_attention.cpp or
csrc/avx512_attention.cpp), which reads the paged context in place; elsewhere they take SDPA
as below.

The C++ kernel (csrc/paged_attention.cpp) computes attention with float32 FMAs, ~70
GFLOPS on two AMX cores; torch's flash SDPA in bfloat16 runs its two matmuls on AMX
(oneDNN/cpublas), several times faster once a chunk has enough query rows to fill its
tiles. So a call's sequences whose chunk has at least `min_rows` new tokens, and at least
`min_work` query x key pairs (q_len x context: SDPA's ~0.05 ms a call costs more than
short chunks at the start of a prompt save), get their context's K/V gathered out of the
paged cache (a few MB a layer, against a quadratic amount of arithmetic) and go through
SDPA, one sequence at a time; the others (decode rows, short chunks) go to the C++ kernel,
one call per run of consecutive ones, on views of the step's tensors.

Causal alignment: a chunk's queries sit at positions ctx - q_len .. ctx - 1 and see keys
0 .. their own position ("bottom-right"). A chunk starting at 0 uses SDPA's is_causal
(top-left, the same thing there, and the kernel skips the masked tiles). A chunk after
earlier context (chunked prefill, a prefix-cache hit) attends in two parts merged by
their log-sum-exps: the earlier context, which every query sees whole (no mask, so the
query heads sharing a KV head fold into one head's rows: no K/V copies), and the
chunk's own keys under is_causal. 1.6-2x faster than SDPA with an explicit mask over
the whole context (2048 queries after 2048 or 6144 tokens, bfloat16, one thread),
whose boolean mask becomes a float [q_len, ctx] tensor read for every head. Under a
sliding window the chunk passes that explicit mask over the keys it can see.

Not batch-invariant: a row's result depends on which path its chunk took, so
`--deterministic` keeps the C++ kernel for every row (see `kernels.cpu.backend`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def attend(kernel: Callable, out: Tensor, query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
           query_start_loc: Tensor, context_lens: Tensor, scale: float, sliding_window: int, min_rows: int,
           min_work: int, chunk_kernel: Callable | None = None) -> None:
    """Fills out [tokens, heads, head_dim]: chunks of >= min_rows tokens and >= min_work
    q_len x context by `chunk_kernel` (the AMX kernel's signature: out, query, caches, the
    sequence's block table, its context length, scale, window) or, without one, SDPA; the rest
    by `kernel` (the C++ paged attention's signature: out first, sliding_window 0 for none)."""
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    dense = [n >= min_rows and n * ctx >= min_work for n, ctx in zip(lens, ctx_lens, strict=True)]
    long = [i for i, d in enumerate(dense) if d]
    if not long:
        kernel(out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window)
        return
    # each run of consecutive short sequences (decode rows come first in a step: usually one run)
    # goes to the kernel as views of the step's tensors; gathering them into a copy cost as much
    # as their attention at 64 decode rows
    i = 0
    while i < len(dense):
        if dense[i]:
            i += 1
            continue
        j = i
        while j < len(dense) and not dense[j]:
            j += 1
        a, e = starts[i], starts[j]
        if e > a:
            qsl = query_start_loc[i : j + 1]
            kernel(out[a:e], query[a:e], k_cache, v_cache, block_tables[i:j], qsl - a if a else qsl,
                   context_lens[i:j], scale, sliding_window)
        i = j
    for i in long:
        s, n = starts[i], lens[i]
        if chunk_kernel is not None:
            chunk_kernel(out[s : s + n], query[s : s + n], k_cache, v_cache, block_tables[i], ctx_lens[i], scale,
                         sliding_window)
            continue
        o = chunk_attention(query[s : s + n], k_cache, v_cache, block_tables[i], ctx_lens[i], scale, sliding_window)
        out[s : s + n] = o


def chunk_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int,
                    scale: float, sliding_window: int) -> Tensor:
    """query [q_len, heads, head_dim] at positions ctx_len - q_len .. ctx_len - 1 over its paged
    context; returns [q_len, heads, head_dim] (a strided view of SDPA's output)."""
    q_len, block_size = query.shape[0], k_cache.shape[1]
    start = ctx_len - q_len
    # the first key any of the chunk's queries sees
    lo = max(0, start - sliding_window + 1) if sliding_window else 0
    first_block = lo // block_size
    blocks = block_table[first_block : -(-ctx_len // block_size)]
    skip = lo - first_block * block_size
    # [blocks, block_size, kv, d] -> [1, kv, keys, d]
    k = k_cache[blocks].flatten(0, 1)[skip : ctx_len - first_block * block_size].permute(1, 0, 2)[None]
    v = v_cache[blocks].flatten(0, 1)[skip : ctx_len - first_block * block_size].permute(1, 0, 2)[None]
    if k.dtype != query.dtype:  # a cache in another dtype (--kv-cache-dtype) reads as the query's
        k, v = k.to(query.dtype), v.to(query.dtype)
    q = query.permute(1, 0, 2)[None]
    if start == 0 and not sliding_window:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif not sliding_window:
        o = _context_then_self(q, k, v, start, scale)
    else:
        q_pos = torch.arange(start, ctx_len)[:, None]
        k_pos = torch.arange(lo, ctx_len)
        mask = k_pos <= q_pos
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _context_then_self(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
    """q [1, heads, q_len, d] at positions start.. over k, v [1, kv_heads, start + q_len, d]:
    softmax over the context part and the causal self part, combined by their log-sum-exps."""
    _, heads, q_len, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    ctx_out, ctx_lse = _flash(q.view(1, kv_heads, group * q_len, d), k[:, :, :start], v[:, :, :start], scale=scale)
    ctx_out, ctx_lse = ctx_out.reshape(1, heads, q_len, d), ctx_lse.reshape(1, heads, q_len)
    k_self, v_self = k[:, :, start:], v[:, :, start:]
    if group > 1:
        k_self, v_self = k_self.repeat_interleave(group, 1), v_self.repeat_interleave(group, 1)
    self_out, self_lse = _flash(q, k_self, v_self, is_causal=True, scale=scale)
    lse = torch.logaddexp(ctx_lse, self_lse)
    o = ctx_out.float() * (ctx_lse - lse).exp()[..., None] + self_out.float() * (self_lse - lse).exp()[..., None]
    return o.to(q.dtype)


def _flash(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: float | None = None):
    """torch's CPU flash attention, the kernel behind SDPA, which also returns each row's log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
