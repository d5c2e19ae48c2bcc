"""benchmarks.scheduler_step runs the real scheduler through decode steps and prints a figure per batch."""

from benchmarks import scheduler_step


def test_scheduler_step_prints_a_time_per_batch(capsys):
    scheduler_step.main(["--batches", "1", "8", "--steps", "5"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["batch", "ms", "per", "step"]
    rows = [line.split() for line in lines[1:]]
    assert [int(r[0]) for r in rows] == [1, 8]
    assert all(float(r[1]) > 0 for r in rows)
