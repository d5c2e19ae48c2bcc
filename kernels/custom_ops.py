"""The kernels as dispatcher ops, so torch.compile traces through them without breaking its graph.

A pybind function is opaque to dynamo: each call would end the graph. As a dispatcher
op (`torch.ops.pagedserve.*`) with a fake implementation (what it allocates, for
tracing), it stays one node of the graph, and inductor calls the real kernel. Ops that
write into their arguments declare it in their schema (`Tensor(a!)`): every C++ op
writes its `out`, `rope_and_cache` also the KV caches and q in the qkv buffer,
`fused_add_rms_norm` x and the residual; functionalization keeps their order and
inductor's re-inplacing calls them on the real buffers (no copies of the caches).

The C++ kernels are registered by the extension itself (`TORCH_LIBRARY_FRAGMENT` in
bindings.cpp, with the pybind functions' signatures), so a compiled graph calls them
with no Python in between: ~2 us of dispatch a call over the pybind call, where a Python
`torch.library.custom_op` wrapper costs ~20 us (about 3 ms of a SmolLM2 decode step's
150 calls). Eager steps call the pybind functions directly, the cheapest, and switch to
the dispatcher ops only while dynamo traces (`torch.compiler.is_compiling()`, a
constant to dynamo and ~0.1 us eagerly: see `kernels.cpu.backend`).

The torch reference's paged attention is a Python custom op here
(`reference_paged_attention`): it reads the context lengths on the host (`tolist`) to
size its gather, which would break the graph in every layer; as an op it runs eagerly
inside the compiled graph, and the rest of the reference ops are traced and fused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor

from kernels import reference


def traced(eager: Callable, op: Callable) -> Callable:
    """`eager` when called eagerly, `op` (a custom op) while dynamo traces the caller."""

    @functools.wraps(eager)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return op(*args, **kwargs)
        return eager(*args, **kwargs)

    return call


@torch.library.custom_op("pagedserve::reference_paged_attention", mutates_args=())
def reference_paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                              query_start_loc: Tensor, context_lens: Tensor, scale: float | None = None,
                              sliding_window: int | None = None) -> Tensor:
    return reference.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                     sliding_window)


@reference_paged_attention.register_fake
def _(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale=None, sliding_window=None):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@functools.cache
def cpu_ops(ext) -> SimpleNamespace:
    """The C++ extension's kernels as dispatcher ops (`torch.ops.pagedserve.*`, registered by the
    extension itself in bindings.cpp, with the pybind functions' signatures: results into `out`),
    given their fake implementations here once per process. `ext` is the loaded extension."""
    del ext  # loading it registered the ops
    ops = torch.ops.pagedserve
    for name in ("paged_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache",
                 "int8_group_linear", "q4_linear", "q4_linear_tiles", "q8_linear", "q8_linear_tiles",
                 "bf16_linear_tiles", "q4_gate_up_silu_tiles", "bf16_gate_up_silu_tiles"):
        # every argument they write is an input: nothing to allocate while tracing
        torch.library.register_fake(f"pagedserve::{name}", _writes_inputs_only)
    return SimpleNamespace(**{name: getattr(ops, name) for name in (
        "paged_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache", "int8_group_linear",
        "q4_linear", "q4_linear_tiles", "q8_linear", "q8_linear_tiles", "bf16_linear_tiles", "q4_gate_up_silu_tiles",
        "bf16_gate_up_silu_tiles")})


def _writes_inputs_only(*args, **kwargs) -> None:
    return None
