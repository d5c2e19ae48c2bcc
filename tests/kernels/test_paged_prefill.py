"""paged_prefill_attention (Triton) against the torch reference: whole prompts, chunks over earlier context."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from tests.kernels.paged_batch import assert_close, build, live_slots, param_id, reference, runnable  # noqa: E402

pytestmark = runnable

BF16, FP16 = torch.bfloat16, torch.float16


def run(inputs, **kwargs):
    return paged_prefill_attention(inputs["query"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
                                   inputs["query_start_loc"], inputs["context_lens"], **kwargs)


def whole_prompts(block_size):
    # one token, two, exactly a block, a partial last block
    return [(1, 1), (2, 2), (block_size, block_size), (3 * block_size + 5, 3 * block_size + 5)]


def chunks(block_size):
    return [
        (37, 1),  # a decode row in a mixed step
        (50, 13),  # chunked prefill over 37 tokens computed earlier
        (2 * block_size, block_size),  # a chunk that starts and ends on block boundaries
        (40, 39),  # prefix-cache hit of one token
        (block_size + 1, 1),  # recompute of the one token past a block
    ]


# block_size, num_heads, num_kv_heads (GQA 1, 3, 4), head_dim, dtype, sequences
CASES = [
    (8, 4, 4, 64, FP16, whole_prompts),
    (16, 6, 2, 128, BF16, whole_prompts),
    (32, 8, 2, 64, BF16, whole_prompts),
    (8, 6, 2, 64, FP16, chunks),
    (16, 8, 2, 128, BF16, chunks),
    (32, 4, 4, 64, BF16, chunks),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,seqs", CASES, ids=param_id)
def test_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype, seqs):
    inputs = build(seqs(block_size), num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = run(inputs)
    assert out.dtype == dtype and out.shape == inputs["query"].shape
    assert_close(out, reference(inputs))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_chunks_longer_than_a_query_tile(num_heads, num_kv_heads):
    # 64 query rows a program: GQA 1 takes 64 tokens a tile, GQA 4 takes 16
    inputs = build([(150, 130), (70, 70), (90, 1)], num_heads, num_kv_heads, 64, 16, BF16)
    assert_close(run(inputs), reference(inputs))


def test_sliding_window():
    seqs = [(30, 1), (30, 30), (45, 10), (5, 1), (80, 70)]
    inputs = build(seqs, 6, 2, 64, 8, FP16)
    assert_close(run(inputs, sliding_window=7), reference(inputs, sliding_window=7))


def test_stale_slots_are_ignored_and_scale_is_used():
    inputs = build(chunks(16), 8, 2, 64, 16, BF16, pad_columns=2)
    live = live_slots(inputs)
    inputs["k_cache"][~live] = 1e4
    inputs["v_cache"][~live] = -1e4
    assert_close(run(inputs, scale=0.2), reference(inputs, scale=0.2))
