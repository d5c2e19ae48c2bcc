"""benchmarks.step_messages: the ExecuteStep it measures is the real message, it survives the
socket's encoding unchanged, and the block tables' share of its bytes grows with the context."""

from __future__ import annotations

from benchmarks import step_messages


def test_step_message_figures_are_real(capsys):
    short, long = step_messages.measure(8, 32, repeat=3), step_messages.measure(8, 1024, repeat=3)
    assert short["bytes"] < long["bytes"] and 0 < short["tables_share"] < long["tables_share"] < 1
    assert all(r["encode_us"] > 0 and r["decode_us"] > 0 for r in (short, long))
    step = step_messages.decode_step(3, 40)
    assert [s.block_table for s in step.seqs] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [s.slot_mapping for s in step.seqs] == [[55], [103], [151]]  # position 39: last block, offset 7
    bare = step_messages.decode_step(3, 40, tables=False)
    assert [s.block_table for s in bare.seqs] == [[], [], []]
    assert [s.slot_mapping for s in bare.seqs] == [s.slot_mapping for s in step.seqs]
    assert step_messages.main(["--shapes", "2x16", "4x64", "--repeat", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["seqs", "context", "KiB"] and [line.split()[:2] for line in lines[1:]] == [
        ["2", "16"], ["4", "64"]]
