"""paged_attention_decode (Triton) against the torch reference, with one partition and split-K."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.paged_decode import paged_attention_decode, partition_size  # noqa: E402
from tests.kernels.paged_batch import assert_close, build, live_slots, param_id, reference, runnable  # noqa: E402

pytestmark = runnable

BF16, FP16 = torch.bfloat16, torch.float16


def decode_seqs(block_size):
    # context 1, exactly one block, a partial last block, two blocks exactly, a long one
    return [(1, 1), (block_size, 1), (2 * block_size + 3, 1), (2 * block_size, 1), (100, 1)]


def run(inputs, **kwargs):
    return paged_attention_decode(inputs["query"], inputs["k_cache"], inputs["v_cache"], inputs["block_tables"],
                                  inputs["context_lens"], **kwargs)


# block_size, num_heads, num_kv_heads (GQA 1, 3, 4), head_dim, dtype, partition (None: one split here)
CASES = [
    (8, 4, 4, 64, FP16, None),
    (16, 6, 2, 128, BF16, None),
    (32, 8, 2, 64, BF16, 32),  # split-K, partitions a block long
    (16, 3, 1, 128, FP16, 32),  # split-K, partitions over two blocks
    (8, 12, 4, 64, BF16, 16),  # many partitions, each two blocks
    (32, 4, 4, 128, FP16, 16),  # partitions half a block long
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,partition", CASES, ids=param_id)
def test_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype, partition):
    inputs = build(decode_seqs(block_size), num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = run(inputs, partition=partition)
    assert out.dtype == dtype and out.shape == inputs["query"].shape
    assert_close(out, reference(inputs))


@pytest.mark.parametrize("partition", [16, 64])
def test_sliding_window(partition):
    # window 20 over context 100: the first partitions hold nothing visible and are skipped
    seqs = [(100, 1), (20, 1), (21, 1), (5, 1), (37, 1)]
    inputs = build(seqs, 6, 2, 64, 8, BF16)
    assert_close(run(inputs, sliding_window=20, partition=partition), reference(inputs, sliding_window=20))


def test_stale_slots_and_wide_tables_are_ignored():
    inputs = build([(10, 1), (70, 1), (16, 1)], 8, 2, 64, 16, FP16, pad_columns=4)
    live = live_slots(inputs)
    inputs["k_cache"][~live] = 1e4
    inputs["v_cache"][~live] = -1e4
    expected = reference(inputs)
    for partition in (None, 16):  # the padded table width adds partitions past every context
        assert_close(run(inputs, partition=partition), expected)


def test_scale_and_strided_query():
    inputs = build(decode_seqs(16), 8, 2, 128, 16, BF16)
    fused = torch.cat([inputs["query"], torch.zeros_like(inputs["query"])], dim=1)
    strided = dict(inputs, query=fused[:, :8])  # a view, rows 16 heads apart, as after a fused projection
    assert_close(run(strided, scale=0.3, partition=32), reference(inputs, scale=0.3))


def test_partition_size_fills_the_device():
    cpu = torch.device("cpu")
    assert partition_size(1, 1, 64, cpu) == 256  # never below the minimum
    assert partition_size(1, 8, 1 << 20, cpu) == 2048  # nor above the maximum
    size = partition_size(2, 4, 4096, cpu)
    assert 256 <= size <= 2048 and size & (size - 1) == 0
