"""The "cpu" attention backend: the C++ extension's paged attention and fused ops.

Registered (preferred on the CPU) only when the extension builds and loads; otherwise
the executor stays on the torch reference, with the warning `kernels.cpu.build` logs.
Signatures and results follow `kernels.reference`, the oracle the tests compare with.
Eager calls go straight to the pybind functions; while torch.compile traces, each op
calls the same kernel as a dispatcher op (`torch.ops.pagedserve.*`, see
`kernels.custom_ops`), which dynamo keeps in its graph instead of breaking it.

Paged attention sends sequences whose query chunk has at least DENSE_MIN_ROWS tokens and
enough query x context pairs to a chunk kernel (`kernels.cpu.chunk_kernels`: on AMX tiles
where the CPU has them, else with AVX512-BF16 dot products where it has those), else to
torch's SDPA (`kernels.cpu.dense_attention`);
`row_invariant_paged_attention` is the C++ kernel alone for every row, which
`--deterministic` takes instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from torch import Tensor

from kernels import reference
from kernels.attention import AttentionBackend
from kernels.cpu import chunk_kernels
from kernels.cpu.build import load
from kernels.cpu.dense_attention import attend
from kernels.custom_ops import cpu_ops

# where a chunk's attention runs faster through SDPA than through the C++ kernel (`python -m
# benchmarks.dense_prefill`, SmolLM2's heads, one layer, 2 threads of an AMX Xeon). The AVX-512 two-pass
# kernel ties SDPA at about 50K query x key pairs whatever the chunk's start (bfloat16: 150 rows from
# position 0 0.85x SDPA's time, 96 rows over 256 keys 0.89x, 32 over 2048 0.91x; 256 from 0 1.4x, 64
# over 2048 1.5x; float32 favours the kernel further). The online kernel (AVX2 and other head sizes)
# gave way from 16 rows and 4096 pairs (1 thread: 16 rows over 256 keys 1.4-1.9x faster by SDPA).
DENSE_MIN_ROWS = 16
DENSE_MIN_WORK = 4096
DENSE_MIN_WORK_TWO_PASS = 49152
# where each chunk kernel overtakes the two-pass kernel (`benchmarks.dense_prefill`, one layer, 2 threads).
# AMX (csrc/amx_attention.cpp, a Xeon): ties it at 32 rows from position 0 (0.038 ms each), 0.35x its
# time at 16 rows over 2048 keys and 0.11-0.57x from 64 rows. AVX512-BF16 (csrc/avx512_attention.cpp,
# an AMD Zen 4, where SDPA lost to the two-pass kernel at every length): ties it at 48 rows from 0 and at
# 64 from 0 (4096 pairs), 0.84x its time at 16 rows over 272 keys, 0.39-0.60x from 128 rows.
CHUNK_MIN_WORK = {"amx": 2048, "avx512_bf16": 4096}
CHUNK_KERNEL_ENV = "PAGEDSERVE_CHUNK_ATTENTION"  # sdpa, amx or avx512_bf16: an A/B, or a suspect kernel set aside


def chosen_chunk_kernel(ext) -> str | None:
    """The kernel long bfloat16 chunks take: $PAGEDSERVE_CHUNK_ATTENTION's (None for sdpa), else the best here."""
    asked = os.environ.get(CHUNK_KERNEL_ENV, "auto")
    if asked == "auto":
        return chunk_kernels.best(ext)
    if asked == "sdpa":
        return None
    if asked not in chunk_kernels.KERNELS or not chunk_kernels.available(ext, asked):
        raise ValueError(f"{CHUNK_KERNEL_ENV}={asked}: choose auto, sdpa or one that runs here "
                         f"({[k for k in chunk_kernels.KERNELS if chunk_kernels.available(ext, k)]})")
    return asked


def make_backend(ext, dense_min_rows: int = DENSE_MIN_ROWS, dense_min_work: int | None = None,
                 chunk: str | None = "auto") -> AttentionBackend:
    """chunk: the kernel for long bfloat16 chunks (`chunk_kernels.KERNELS`), None for SDPA, "auto" for
    `chosen_chunk_kernel`'s."""
    if chunk == "auto":
        chunk = chosen_chunk_kernel(ext)
    if dense_min_work is None:
        dense_min_work = (CHUNK_MIN_WORK[chunk] if chunk else DENSE_MIN_WORK_TWO_PASS if ext.two_pass_attention()
                          else DENSE_MIN_WORK)
    chunk_kernel = chunk_kernels.kernel(ext, chunk) if chunk else None
    ops = cpu_ops(ext)
    compiling = torch.compiler.is_compiling  # a constant True to dynamo; ~0.1 us eagerly

    def kernels():
        return ops if compiling() else ext

    def kernel_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         query_start_loc: Tensor, context_lens: Tensor, scale: float | None = None,
                         sliding_window: int | None = None) -> Tensor:
        out = torch.empty(query.shape, dtype=query.dtype)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        kernels().paged_attention(out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                  scale, sliding_window or 0)
        return out

    def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                        query_start_loc: Tensor, context_lens: Tensor, scale: float | None = None,
                        sliding_window: int | None = None) -> Tensor:
        # fewer rows than dense_min_rows in all: no chunk can be long (decode steps never read the lengths);
        # compiled graphs are decode-only
        if query.shape[0] < dense_min_rows or compiling():
            return kernel_attention(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                    sliding_window)
        out = torch.empty(query.shape, dtype=query.dtype)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        attend(ext.paged_attention, out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
               scale, sliding_window or 0, dense_min_rows, dense_min_work,
               chunk_kernel if chunk_kernel and _chunk_shapes(query, k_cache) else None)
        return out

    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = torch.empty_like(x)
        kernels().rms_norm(out, x, weight, eps)
        return out

    def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        x, residual = x.contiguous(), residual.contiguous()
        kernels().fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(x: Tensor) -> Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        kernels().silu_and_mul(out, x.contiguous())
        return out

    def rope_and_cache(qkv: Tensor, positions: Tensor, cos_sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       slot_mapping: Tensor, num_heads: int, num_kv_heads: int) -> Tensor:
        kernels().rope_and_cache(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        head_dim = k_cache.shape[-1]
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)

    def int8_group_linear(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
        out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
        kernels().int8_group_linear(out, x.contiguous(), qweight, scales)
        return out

    def coded_linear(name: str) -> Callable[..., Tensor]:
        def linear(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor, out: Tensor | None = None) -> Tensor:
            """x @ w.T in x's dtype (the kernel rounds its float32 sums once, as a float32 result's .to() would);
            out: a float32 or x-typed [rows, out_features] to write into instead of a new tensor."""
            if out is None:
                out = torch.empty(x.shape[0], d.shape[0] * d.shape[2], dtype=x.dtype)
            getattr(kernels(), name)(out, x.contiguous(), packed, d, mn)
            return out

        return linear

    def bf16_linear_tiles(x: Tensor, packed: Tensor, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.empty(x.shape[0], packed.shape[0] * 16, dtype=x.dtype)
        kernels().bf16_linear_tiles(out, x.contiguous(), packed)
        return out

    def q4_gate_up_silu_tiles(x: Tensor, packed: Tensor, d: Tensor, mn: Tensor) -> Tensor:
        out = torch.empty(x.shape[0], d.shape[0] * d.shape[2] // 2, dtype=x.dtype)
        kernels().q4_gate_up_silu_tiles(out, x.contiguous(), packed, d, mn)
        return out

    def bf16_gate_up_silu_tiles(x: Tensor, packed: Tensor) -> Tensor:
        out = torch.empty(x.shape[0], packed.shape[0] * 8, dtype=x.dtype)
        kernels().bf16_gate_up_silu_tiles(out, x.contiguous(), packed)
        return out

    tiles = bool(ext.q4_linear_tiles_rows())
    return AttentionBackend(
        name="cpu",
        write_kv_to_cache=reference.write_kv_to_cache,
        paged_attention=paged_attention,
        row_invariant_paged_attention=kernel_attention,
        copy_blocks=reference.copy_blocks,
        devices=("cpu",),
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        silu_and_mul=silu_and_mul,
        rope_and_cache=rope_and_cache,
        int8_group_linear=int8_group_linear,
        q4_linear=coded_linear("q4_linear"),  # Q4_1 codes (kernels.reference.q4_pack)
        q8_linear=coded_linear("q8_linear"),  # 8-bit codes (kernels.reference.q8_pack)
        # Q4_1 on AMX tiles (kernels.reference.q4_linear_tiles), for bfloat16 steps of many rows
        q4_linear_tiles=coded_linear("q4_linear_tiles") if tiles else None,
        q4_tiles_min_rows=ext.q4_linear_tiles_rows(),
        q8_linear_tiles=coded_linear("q8_linear_tiles") if tiles else None,
        # dense bfloat16 weights prepacked for the tiles (kernels.reference.pack_tiles), for --prepack
        bf16_linear_tiles=bf16_linear_tiles if tiles else None,
        q4_gate_up_silu_tiles=q4_gate_up_silu_tiles if tiles else None,
        bf16_gate_up_silu_tiles=bf16_gate_up_silu_tiles if tiles else None,
    )


def _chunk_shapes(query: Tensor, k_cache: Tensor) -> bool:
    """What the chunk kernels take: bfloat16 queries and cache, head_dim 64, each token's heads contiguous."""
    return (query.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and query.shape[-1] == 64
            and query.stride(-1) == 1 and query.stride(-2) == 64)


def backend() -> AttentionBackend | None:
    ext = load()
    return None if ext is None else make_backend(ext)
