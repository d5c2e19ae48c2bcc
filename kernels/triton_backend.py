"""The Triton attention backend: the kernels behind `AttentionBackend`, registered on import.

A step whose every sequence brings one new token (as many query rows as block-table
rows) goes to the split-K decode kernel; any other step, decode rows mixed in
included, goes to the prefill kernel. Telling them apart from shapes keeps a call
free of host syncs, which CUDA-graph capture needs.

It runs on CUDA, and on the CPU only under Triton's interpreter (TRITON_INTERPRET=1
when this module is imported), where it is slow but exact enough to test against.
"""

from __future__ import annotations

import functools

from torch import Tensor

from kernels import reference
from kernels.attention import AttentionBackend, register_backend
from kernels.cache_ops import copy_blocks, write_kv_to_cache
from kernels.paged_decode import _decode_kernel, paged_attention_decode
from kernels.paged_prefill import paged_prefill_attention
from kernels.triton_utils import is_interpreted


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
    """Arguments and result as `kernels.reference.paged_attention`."""
    if query.shape[0] == block_tables.shape[0]:
        return paged_attention_decode(query, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
    return paged_prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                   scale, sliding_window)


TRITON = AttentionBackend(
    name="triton",
    write_kv_to_cache=write_kv_to_cache,
    paged_attention=paged_attention,
    copy_blocks=copy_blocks,
    devices=("cuda",),
    slow_devices=("cpu",) if is_interpreted(_decode_kernel) else (),
    graph_safe=True,
    # its cache write skips the padding rows (slot -1) of a CUDA graph's batch
    rope_and_cache=functools.partial(reference.rope_and_cache, write_kv=write_kv_to_cache),
)
register_backend(TRITON, preferred=True)
