"""The commands end to end against fake servers: JSON, tables and PNGs written."""

from __future__ import annotations

import json

import pytest

from loadgen.cli import main
from tests.loadgen.fake_server import FakeConfig, FakeServer

WORKLOAD = ["--dataset", "random", "--input-len", "16", "--output-len", "4", "--tokenizer", "words",
            "--warmup", "1", "--no-progress", "--seed", "3"]
REQUIRED = ["completed", "failed", "duration_s", "request_throughput", "output_throughput"]
LATENCIES = ["ttft_s", "tpot_s", "itl_s", "e2e_s", "normalized_latency_s"]


@pytest.mark.parametrize("load", [["--request-rate", "50"], ["--concurrency", "3"]])
def test_run_writes_the_summary_json(tmp_path, capsys, load):
    out = tmp_path / "run.json"
    with FakeServer(FakeConfig(ttft=0.02, itl=0.005)) as server:
        rc = main(["run", "--url", server.url, "--name", "fake", *WORKLOAD, *load, "--num-requests", "10",
                   "--slo", "ttft=1,e2e=2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert all(k in data for k in REQUIRED)
    assert (data["completed"], data["failed"]) == (10, 0)
    for key in LATENCIES:
        assert set(data[key]) == {"mean", "median", "p90", "p99"}
        assert all(v > 0 for v in data[key].values())
    assert data["goodput"] == pytest.approx(data["request_throughput"])
    assert len(data["requests"]) == 10 and data["target"]["model"] == "fake-model"
    printed = capsys.readouterr().out
    assert "fake: 10 completed, 0 failed" in printed and "| Normalized   |" in printed


def test_run_refuses_an_unbounded_load(capsys):
    rc = main(["run", "--url", "http://127.0.0.1:9", *WORKLOAD, "--request-rate", "inf"])
    assert rc == 2 and "number of requests" in capsys.readouterr().err


def test_compare_alternates_targets_and_writes_table_and_plot(tmp_path, capsys):
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as fast, FakeServer(FakeConfig(ttft=0.05, itl=0.01)) as slow:
        rc = main(["compare", "--target", f"fast={fast.url}", "--target", f"slow={slow.url}", *WORKLOAD,
                   "--concurrency", "2", "--num-requests", "6", "--repeats", "2", "--out-dir", str(tmp_path)])
        assert rc == 0
        # Each of 2 runs per target: 1 length-control probe, 1 warm-up and 6 measured requests.
        assert len(fast.bodies) == len(slow.bodies) == 16
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [len(data["runs"][n]) for n in ("fast", "slow")] == [2, 2]
    table = (tmp_path / "compare.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert {"fast", "slow"} <= set(rows)
    ttft_p50 = {n: float(rows[n].split("|")[4]) for n in ("fast", "slow")}
    assert ttft_p50["fast"] < ttft_p50["slow"]
    assert (tmp_path / "compare.png").stat().st_size > 20_000
    assert "medians of 2 alternating repeats" in capsys.readouterr().out


def test_compare_replays_a_duration_bounded_trace(tmp_path):
    with FakeServer(FakeConfig(ttft=0.005, itl=0.001)) as server:
        rc = main(["compare", "--target", f"a={server.url}", *WORKLOAD, "--request-rate", "40", "--duration", "0.3",
                   "--repeats", "2", "--out-dir", str(tmp_path)])
    assert rc == 0
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]["a"]
    prompts = [[r["prompt_len"] for r in run["requests"]] for run in runs]
    assert len(prompts[0]) > 3 and prompts[0] == prompts[1]  # the same seeded requests both times


def test_sweep_writes_curves(tmp_path):
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as server:
        rc = main(["sweep", "--target", f"fake={server.url}", *WORKLOAD, "--rates", "20,80", "--num-requests", "8",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["rate"] for p in data["fake"]] == [20.0, 80.0]
    assert all(p["completed"] == 8 for p in data["fake"])
    assert (tmp_path / "sweep.png").stat().st_size > 20_000


def test_capacity_command(tmp_path, capsys):
    with FakeServer(FakeConfig(ttft=0.01, itl=0.002)) as server:
        rc = main(["capacity", "--target", f"fake={server.url}", *WORKLOAD, "--slo", "e2e=5", "--probe-seconds",
                   "1", "--probe-min-requests", "16", "--start-rate", "10", "--max-rate", "20",
                   "--out", str(tmp_path / "cap.json")])
        # Per probe: 1 length-control request, 1 warm-up and max(16, 1 s x rate) measured requests.
        assert len(server.bodies) == (2 + 16) + (2 + 20)
        # the second probe measures new requests: none of its prompts was cached by the first
        prompts = [json.dumps(b.get("prompt") or b.get("messages")) for b in server.bodies]
        assert len(set(prompts)) >= 16 + 20
    assert rc == 0
    data = json.loads((tmp_path / "cap.json").read_text())
    fake = data["targets"]["fake"]
    assert fake["capacity"] == 20.0 and fake["stopped"] == "max rate passed"
    probes = [p["summary"] for p in fake["probes"]]
    assert [p["requests_sent"] for p in probes] == [16, 20]
    for p in probes:  # the first quarter of each probe is its warm-up, the rest is judged
        assert p["steady_state"]["settled"] and p["completed"] + p["warmup_requests"] == p["requests_sent"]
        assert p["warmup_requests"] >= 3
    assert "| fake   |" in capsys.readouterr().out


def test_capacity_refuses_a_fixed_probe_size(capsys):
    rc = main(["capacity", "--target", "a=http://127.0.0.1:9", *WORKLOAD, "--slo", "e2e=5", "--num-requests", "10"])
    assert rc == 2 and "sizes each probe itself" in capsys.readouterr().err
