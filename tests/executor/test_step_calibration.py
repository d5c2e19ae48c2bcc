"""The quantized copies' row limits chosen from timed decode steps (services.executor.step_calibration).

- The calibration steps are valid decode steps: distinct blocks per sequence, block 0
  untouched, each new token's slot at its position; none when the pool is too small.
- The crossover keeps the largest row count whose quantized step is faster, stops at
  the first that is not, and leaves that limit set (timer replaced by a fixed cost model).
- A runner loading a 4-bit checkpoint calibrates on its own pool unless
  `int4_max_rows` pins the limit, and its greedy step still runs after calibration.
"""

from __future__ import annotations

import pytest
import torch

from services.executor import quantization as q
from services.executor import step_calibration as sc
from services.executor.model_runner import ModelRunner
from tests.executor.test_quantization import _q4_1_checkpoint

pytestmark = pytest.mark.skipif(not q.supported("cpu"), reason="this torch has no CPU int4 kernel")


def test_decode_steps_use_their_own_blocks_and_slots():
    step = sc.decode_step(rows=3, context=40, block_size=16, num_blocks=10)
    tables = [s.block_table for s in step.seqs]
    assert [len(t) for t in tables] == [3, 3, 3]
    used = [b for t in tables for b in t]
    assert len(set(used)) == 9 and 0 not in used and max(used) < 10
    for s in step.seqs:
        assert s.start_pos == 39 and len(s.token_ids) == 1 and s.sample
        assert s.slot_mapping == [s.block_table[39 // 16] * 16 + 39 % 16]
    assert sc.decode_step(rows=4, context=40, block_size=16, num_blocks=10) is None


class _Runner:
    block_size, num_kv_blocks, device = 16, 4096, torch.device("cpu")


def test_crossover_keeps_the_largest_faster_row_count(monkeypatch):
    limit = {"rows": None}
    # a cost model: quantized steps cost 1 + m/8, dense ones 2 (quantized wins below 8 rows)
    monkeypatch.setattr(sc, "_forward_time",
                        lambda runner, meta: 1 + meta.num_seqs / 8 if limit["rows"] else 2.0)
    monkeypatch.setattr(sc.BatchMetadata, "from_step",
                        staticmethod(lambda step, *a: type("M", (), {"num_seqs": len(step.seqs)})()))
    tried = []

    def use_rows(m):
        limit["rows"] = m
        tried.append(m)

    best = sc.crossover(_Runner(), use_rows, "test", context=32, rows=(1, 2, 4, 8, 16), reps=2)
    assert best == 4 and limit["rows"] == 4
    assert 16 not in tried  # stopped at 8, the first row count where quantized is not faster


def test_crossover_serves_every_step_when_quantized_wins_at_every_size_timed(monkeypatch):
    limit = {"rows": None}
    monkeypatch.setattr(sc, "_forward_time", lambda runner, meta: 1.0 if limit["rows"] else 2.0)
    contexts = []

    def from_step(step, *a):
        contexts.append(len(step.seqs[0].block_table))
        return None
    monkeypatch.setattr(sc.BatchMetadata, "from_step", staticmethod(from_step))

    class Small(_Runner):
        num_kv_blocks = 65  # 64 sequences of 4 blocks do not fit: their context is halved twice
    best = sc.crossover(Small(), lambda m: limit.update(rows=m), "test", context=64, rows=(1, 64), reps=1)
    assert best == q.ALL_ROWS and limit["rows"] == q.ALL_ROWS
    assert contexts == [4, 1, 64]  # then a prompt chunk of 1024 tokens (64 blocks) was timed too
    assert q.rows_text(best) == "every step" and q.rows_text(8) == "steps of at most 8 tokens"


def test_crossover_stops_at_the_largest_decode_size_when_a_prompt_chunk_is_slower_quantized(monkeypatch):
    limit = {"rows": None}
    chunk = {"rows": 0}

    def from_step(step, *a):
        chunk["rows"] = len(step.seqs[0].token_ids)
        return None

    def forward_time(runner, meta):  # quantized wins on decode steps, loses on the prompt chunk
        wins = chunk["rows"] == 1
        return (1.0 if wins else 3.0) if limit["rows"] else 2.0
    monkeypatch.setattr(sc, "_forward_time", forward_time)
    monkeypatch.setattr(sc.BatchMetadata, "from_step", staticmethod(from_step))
    best = sc.crossover(_Runner(), lambda m: limit.update(rows=m), "test", context=32, rows=(1, 64), reps=1)
    assert best == 64 and limit["rows"] == 64
    assert chunk["rows"] == sc.PREFILL_ROWS


def test_crossover_is_zero_when_quantized_never_wins(monkeypatch):
    limit = {"rows": None}
    monkeypatch.setattr(sc, "_forward_time", lambda runner, meta: 3.0 if limit["rows"] else 2.0)
    monkeypatch.setattr(sc.BatchMetadata, "from_step", staticmethod(lambda *a: None))
    best = sc.crossover(_Runner(), lambda m: limit.update(rows=m), "test", context=32, rows=(1, 2), reps=1)
    assert best == 0 and limit["rows"] == 0


def test_tiles_onset_is_the_smallest_row_count_where_tiles_win(monkeypatch):
    copies = [type("Copy", (), {"max_rows": 0, "tiles_from": q.ALL_ROWS})() for _ in range(2)]
    # a cost model: the integer path costs m, the tiles 40 + m/4 (faster from 54 rows on)
    monkeypatch.setattr(sc, "_forward_time", lambda runner, meta: (
        40 + meta.num_seqs / 4 if meta.num_seqs >= copies[0].tiles_from else float(meta.num_seqs)))
    monkeypatch.setattr(sc.BatchMetadata, "from_step",
                        staticmethod(lambda step, *a: type("M", (), {"num_seqs": len(step.seqs)})()))
    assert sc.tiles_onset(_Runner(), copies, context=32, rows=(16, 32, 64, 128), reps=2) == 64
    assert all(c.tiles_from == 64 and c.max_rows == q.ALL_ROWS for c in copies)
    monkeypatch.setattr(sc, "_forward_time", lambda runner, meta: (
        2.0 if meta.num_seqs >= copies[0].tiles_from else 1.0))
    assert sc.tiles_onset(_Runner(), copies, context=32, rows=(16, 32), reps=1) == q.ALL_ROWS
    assert all(c.tiles_from == q.ALL_ROWS for c in copies)


def test_a_runner_calibrates_on_decode_steps_unless_pinned(tiny_model_dir, tmp_path, monkeypatch):
    q4_dir = _q4_1_checkpoint(tiny_model_dir, tmp_path / "q4")
    calls = []
    real = sc.crossover
    monkeypatch.setattr(sc, "crossover", lambda runner, use, label, *a, **k: calls.append(label) or real(
        runner, use, label, *a, rows=(1, 2), reps=1, **k))
    runner = ModelRunner(q4_dir, dtype="float32", num_kv_blocks=64, quantization="auto")
    assert calls == ["int4 linears", "int8 head"]
    limits = {m.int4.max_rows for m in runner.model.decoder_linears()}
    # faster at both sizes timed: up to 2, or every step if also faster on a prompt chunk
    assert len(limits) == 1 and limits <= {0, 1, 2, q.ALL_ROWS}
    assert runner.model.head_int8.max_rows in (0, 1, 2, q.ALL_ROWS)
    step = sc.decode_step(2, 20, runner.block_size, runner.num_kv_blocks)
    assert len(runner.execute(step)) == 2

    calls.clear()
    pinned = ModelRunner(q4_dir, dtype="float32", num_kv_blocks=64, quantization="auto", int4_max_rows=4)
    assert calls == []
    assert {m.int4.max_rows for m in pinned.model.decoder_linears()} == {4}


def test_mixed_steps_add_a_prompt_chunk_on_blocks_of_its_own():
    step = sc.mixed_step(decode_rows=3, chunk=40, context=40, block_size=16, num_blocks=20)
    *decode, prompt = step.seqs
    assert len(decode) == 3 and all(len(s.token_ids) == 1 for s in decode)
    assert prompt.start_pos == 0 and len(prompt.token_ids) == 40 and len(prompt.block_table) == 3
    used = [b for s in step.seqs for b in s.block_table]
    assert len(set(used)) == 12 and 0 not in used and max(used) < 20
    assert prompt.slot_mapping == [prompt.block_table[p // 16] * 16 + p % 16 for p in range(40)]
    assert sc.mixed_step(decode_rows=3, chunk=40, context=40, block_size=16, num_blocks=12) is None


def test_int4_crossover_times_larger_steps_with_a_prompt_chunk(monkeypatch):
    shapes, limit = [], {"rows": 0}
    monkeypatch.setattr(sc, "_forward_time", lambda runner, meta: 1.0 if limit["rows"] else 2.0)
    monkeypatch.setattr(sc.BatchMetadata, "from_step", staticmethod(
        lambda step, *a: shapes.append([len(s.token_ids) for s in step.seqs]) or object()))
    sc.crossover(_Runner(), lambda m: limit.update(rows=m), "test", context=32, rows=(64, 128), reps=1,
                 mixed_above=64)
    assert shapes[0] == [1] * 64 and shapes[1] == [1] * 64 + [64]
