"""The reference paged-attention ops against dense attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import copy_blocks, paged_attention, write_kv_to_cache

HEAD_DIM = 32


def dense_attention(q, k, v, sliding_window=None):
    """q [q_len, H, d] at the last q_len positions of k/v [ctx, kv, d]; float64 oracle."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    k_pos = torch.arange(ctx)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()


def build_batch(seqs, num_heads, num_kv_heads, block_size, seed=0):
    """seqs: (context_len, q_len) pairs. Scatters each context over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_needed)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    dense_k, dense_v, queries = [], [], []
    for i, ((ctx, q_len), n) in enumerate(zip(seqs, blocks_needed, strict=True)):
        table = [free.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(table)
        k = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(ctx, num_kv_heads, HEAD_DIM, generator=gen)
        for pos in range(ctx):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(q_len, num_heads, HEAD_DIM, generator=gen))
    q_lens = [q_len for _, q_len in seqs]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    context_lens = torch.tensor([ctx for ctx, _ in seqs])
    return dict(
        query=torch.cat(queries), k_cache=k_cache, v_cache=v_cache, block_tables=tables,
        query_start_loc=query_start_loc, context_lens=context_lens,
    ), (queries, dense_k, dense_v)


def check(seqs, num_heads, num_kv_heads, block_size, sliding_window=None):
    inputs, (queries, dense_k, dense_v) = build_batch(seqs, num_heads, num_kv_heads, block_size)
    out = paged_attention(**inputs, sliding_window=sliding_window)
    starts = inputs["query_start_loc"].tolist()
    for i, (q, k, v) in enumerate(zip(queries, dense_k, dense_v, strict=True)):
        expected = dense_attention(q, k, v, sliding_window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_decode_batch(block_size, num_heads, num_kv_heads):
    # context 1, one exactly at a block boundary, a partial last block, a long one
    seqs = [(1, 1), (block_size, 1), (block_size * 2 + 3, 1), (100, 1), (block_size + 1, 1)]
    check(seqs, num_heads, num_kv_heads, block_size)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_prefill(block_size, num_heads, num_kv_heads):
    seqs = [(1, 1), (2, 2), (block_size, block_size), (block_size * 3 + 5, block_size * 3 + 5)]
    check(seqs, num_heads, num_kv_heads, block_size)


@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_decode_prefill_and_chunks(block_size):
    seqs = [
        (37, 1),  # decode
        (20, 20),  # whole prompt
        (50, 13),  # chunked prefill over 37 tokens computed earlier
        (block_size * 2, block_size),  # a chunk that starts and ends on block boundaries
        (9, 1),  # decode
        (40, 39),  # prefix-cache hit of one token
    ]
    check(seqs, 6, 2, block_size)


def test_sliding_window():
    seqs = [(30, 1), (30, 30), (45, 10), (5, 1)]
    check(seqs, 4, 2, 8, sliding_window=7)


def test_unused_table_entries_and_extra_blocks_are_ignored():
    inputs, (queries, dense_k, dense_v) = build_batch([(10, 1), (70, 1)], 4, 2, 16)
    # huge values everywhere outside the live context must not leak into the output (the pool
    # starts zeroed, so stale slots always hold finite values)
    live = torch.zeros(inputs["k_cache"].shape[:2], dtype=torch.bool)
    for row, ctx in zip(inputs["block_tables"], inputs["context_lens"].tolist(), strict=True):
        for pos in range(ctx):
            live[row[pos // 16], pos % 16] = True
    inputs["k_cache"][~live] = 1e4
    inputs["v_cache"][~live] = -1e4
    inputs["block_tables"] = torch.cat([inputs["block_tables"], torch.zeros(2, 3, dtype=torch.long)], 1)
    out = paged_attention(**inputs)
    for i in range(2):
        torch.testing.assert_close(out[i : i + 1], dense_attention(queries[i], dense_k[i], dense_v[i]),
                                   atol=1e-5, rtol=1e-5)


def test_write_kv_to_cache():
    k_cache = torch.zeros(6, 4, 2, HEAD_DIM)
    v_cache = torch.zeros(6, 4, 2, HEAD_DIM)
    key = torch.randn(5, 2, HEAD_DIM)
    value = torch.randn(5, 2, HEAD_DIM)
    slots = torch.tensor([21, 22, 23, 4, 0])  # block 5 offsets 1-3, block 1 offset 0, block 0 offset 0
    write_kv_to_cache(key, value, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 4, slot % 4], key[i])
        assert torch.equal(v_cache[slot // 4, slot % 4], value[i])
    written = torch.zeros(24, dtype=torch.bool)
    written[slots] = True
    assert k_cache.view(24, -1)[~written].abs().sum() == 0
    assert v_cache.view(24, -1)[~written].abs().sum() == 0


def test_copy_blocks():
    k_caches = [torch.randn(6, 4, 2, HEAD_DIM) for _ in range(3)]
    v_caches = [torch.randn(6, 4, 2, HEAD_DIM) for _ in range(3)]
    before_k = [c.clone() for c in k_caches]
    before_v = [c.clone() for c in v_caches]
    copy_blocks(k_caches, v_caches, [(1, 4), (2, 5), (4, 0)])  # 4 is read before it is overwritten
    for caches, before in ((k_caches, before_k), (v_caches, before_v)):
        for cache, old in zip(caches, before, strict=True):
            assert torch.equal(cache[4], old[1])
            assert torch.equal(cache[5], old[2])
            assert torch.equal(cache[0], old[4])
            for untouched in (1, 2, 3):
                assert torch.equal(cache[untouched], old[untouched])
    copy_blocks(k_caches, v_caches, [])
