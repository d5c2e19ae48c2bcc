"""Decode attention timing: the paged Triton kernel against torch's SDPA over contiguous K/V.

Both attend the same tokens: the paged kernel through a scattered block table, SDPA
over the same K/V gathered into one contiguous [batch, kv_heads, context, head_dim]
tensor (flash backend on CUDA, grouped-query heads native). On CUDA each is timed as
a CUDA graph of `inner` back-to-back calls, so the figures are device time, not
Python launch overhead. On the CPU (Triton's interpreter) the figures mean nothing;
the run only shows that every step works and the outputs agree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.paged_decode import paged_attention_decode


@dataclass
class Row:
    batch: int
    context: int
    paged_us: float
    contiguous_us: float
    max_diff: float

    @property
    def slowdown(self) -> float:
        return self.paged_us / self.contiguous_us - 1


def make_inputs(batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    shape = (batch * per_seq, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(device)
    query = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype).to(device)
    context_lens = torch.full((batch,), context, device=device)
    # the same tokens, contiguous: [batch, kv_heads, context, head_dim]
    k = k_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = v_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    return query, k_cache, v_cache, tables, context_lens, k, v


def contiguous_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """SDPA over contiguous K/V, flash on CUDA; K/V expanded per query head if flash refuses GQA."""
    q = query[:, :, None, :]
    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]

    def gqa():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]

    try:
        gqa()
        return gqa
    except RuntimeError:
        group = query.shape[1] // k.shape[1]
        k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def expanded():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k_full, v_full)[:, :, 0]

        print("  (flash refused enable_gqa: contiguous K/V expanded per query head)")
        return expanded


def time_us(fn: Callable[[], object], device: torch.device, inner: int, repeats: int) -> float:
    """Median microseconds a call."""
    fn()  # compile, warm up
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(samples)


def measure(batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype, device, partition,
            inner, repeats) -> Row:
    query, k_cache, v_cache, tables, context_lens, k, v = make_inputs(
        batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype, device)

    def paged():
        return paged_attention_decode(query, k_cache, v_cache, tables, context_lens, partition=partition)

    contiguous = contiguous_attention(query, k, v)
    diff = (paged().float() - contiguous().float()).abs().max().item()
    return Row(batch, context, time_us(paged, device, inner, repeats), time_us(contiguous, device, inner, repeats),
               diff)


def run(batches, contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
        partition=None, inner=20, repeats=10) -> list[Row]:
    rows = []
    for batch in batches:
        for context in contexts:
            rows.append(measure(batch, context, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                                partition, inner, repeats))
            print(format_row(rows[-1]), flush=True)
    return rows


HEADER = f"{'batch':>5} {'context':>7} {'paged us':>10} {'SDPA us':>10} {'paged vs SDPA':>13} {'max |diff|':>10}"


def format_row(row: Row) -> str:
    return (f"{row.batch:>5} {row.context:>7} {row.paged_us:>10.1f} {row.contiguous_us:>10.1f} "
            f"{row.slowdown:>+12.1%} {row.max_diff:>10.2e}")
