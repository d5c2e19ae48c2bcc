"""BatchMetadata: the decode fast path (one new token per sequence) builds the same tensors as
the general path, and rejects the same bad steps with InvalidStep."""

from __future__ import annotations

import random

import pytest
import torch

from services.executor.batch import BatchMetadata, InvalidStep
from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)
BLOCK = 16


def decode_seq(i: int, context: int, table: list[int], sample: bool = True, slot: int | None = None) -> ScheduledSeq:
    pos = context - 1
    if slot is None:
        slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
    return ScheduledSeq(f"r{i}", [100 + i], pos, table, [slot], sample, 0, GREEDY)


def random_decode_step(rng: random.Random, n: int, pool: int = 200) -> ExecuteStep:
    blocks = rng.sample(range(pool), pool)
    seqs = []
    for i in range(n):
        context = rng.randint(1, 90)
        need = -(-context // BLOCK) + rng.randint(0, 1)  # sometimes a block beyond the context
        seqs.append(decode_seq(i, context, [blocks.pop() for _ in range(need)], sample=rng.random() < 0.8))
    return ExecuteStep(1, seqs)


@pytest.mark.parametrize("n", [1, 3, 17])
def test_the_decode_path_equals_the_general_one(n):
    rng = random.Random(n)
    for _ in range(20):
        step = random_decode_step(rng, n)
        fast = BatchMetadata.from_step(step, BLOCK, 200)
        general = BatchMetadata._general(step, BLOCK, 200, "cpu")
        for field in ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables",
                      "sample_indices"):
            a, b = getattr(fast, field), getattr(general, field)
            assert a.dtype == b.dtype and torch.equal(a, b), field
        for field in ("sampled_seqs", "query_lens", "decode_seqs", "block_size", "scored_seqs"):
            assert getattr(fast, field) == getattr(general, field), field


@pytest.mark.parametrize("seq", [
    decode_seq(0, 20, [3, 4], slot=4 * BLOCK + 4),  # slot disagrees with the table
    decode_seq(0, 20, [3, 250]),  # block outside the pool
    decode_seq(0, 40, [3, 4], slot=0),  # table too short for the context
    ScheduledSeq("r", [1], -1, [3], [0], True, 0, GREEDY),  # negative position
    ScheduledSeq("r", [1], 5, [3], [53, 54], True, 0, GREEDY),  # two slots for one token
])
def test_bad_decode_steps_fail_on_both_paths(seq):
    step = ExecuteStep(1, [decode_seq(1, 5, [7]), seq])
    with pytest.raises(InvalidStep):
        BatchMetadata.from_step(step, BLOCK, 200)
    with pytest.raises(InvalidStep):
        BatchMetadata._general(step, BLOCK, 200, "cpu")


def test_a_step_with_a_prefill_chunk_takes_the_general_path():
    prefill = ScheduledSeq("p", [1, 2, 3], 0, [9], [144, 145, 146], True, 0, GREEDY)
    meta = BatchMetadata.from_step(ExecuteStep(1, [decode_seq(0, 20, [3, 4]), prefill]), BLOCK, 200)
    assert meta.query_lens == [1, 3] and meta.decode_seqs == [0]
    assert meta.sample_indices.tolist() == [0, 3] and meta.positions.tolist() == [19, 0, 1, 2]
