"""benchmarks.serve_vs_peers as a user runs it: one real process, a real pagedserve on the tiny
model, tiny settings. Checks that real figures come out (no timing asserts) and that peers
that cannot run are reported, not fatal; and that the lean loop decodes as transformers does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import engine_counters, machine, serve_vs_peers
from benchmarks.lean_loop import LeanDecoder
from loadgen.peers import vllm_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("svp")
    cmd = [sys.executable, "-m", "benchmarks.serve_vs_peers", "--quick", "--model", str(tiny_model_dir),
           "--dataset", "sharegpt-paper", "--output-len", "8", "--concurrency", "1", "3", "--lean-batch", "4",
           "--gemm-seconds", "0.02", "--threads", "2", "--log-dir", str(out / "logs"), "--out", str(out / "r.json")]
    # No peer venvs: the peers are reported, never started on the tiny model (minutes for vLLM).
    env = {**os.environ, "LOADGEN_PEERS_VENV": str(out / "none"), "LOADGEN_VLLM_VENV": str(out / "none")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads((out / "r.json").read_text())


def test_pagedserve_gets_real_figures(quick_run):
    _, data = quick_run
    ours = data["servers"]["pagedserve"]
    assert ours["unavailable"] is None and set(ours["points"]) == {"1", "3"}
    assert any(c.startswith("dtype auto -> ") for c in ours["chosen"]), ours["chosen"]  # what its defaults chose
    for c, rec in ours["points"].items():
        assert rec["failed"] == 0 and rec["completed"] == rec["sent"] == rec["requests"] >= int(c) + 1
        assert rec["output_tok_s"] > 0 and rec["short_outputs"] == 0
        assert rec["ttft_s"]["median"] > 0 and rec["tpot_s"]["p99"] >= rec["tpot_s"]["median"] > 0
        # read from the engine's own counters around the point: cold prompts, so some were computed
        assert 0 < rec["computed_prompt_per_output"] and 0 <= rec["outside_forward"] < 1
    assert all(g["gflops"] > 0 and g["tok_s_ceiling"] > 0 for g in data["gemm"])
    assert {g["dtype"] for g in data["gemm"]} == {"float32", "bfloat16"} and {g["rows"] for g in data["gemm"]} == {64, 1024}
    assert [r["dtype"] for r in data["lean_loop"]] == ["float32", "bfloat16"]
    assert all(r["tok_s"] > 0 and r["batch"] == 4 for r in data["lean_loop"])
    assert set(data["machine"]["features"]) >= {"AVX2", "AVX-512", "AMX"} and data["machine"]["torch_threads"] >= 1


def test_the_table_has_every_server_and_says_why_a_peer_did_not_run(quick_run):
    stdout, data = quick_run
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ")]
    by_server = {(r[0], r[1]): r for r in rows[1:]}
    for c in ("1", "3"):
        ours = by_server[(c, "pagedserve")]
        assert float(ours[2]) == pytest.approx(data["servers"]["pagedserve"]["points"][c]["output_tok_s"], rel=1e-3)
        assert float(ours[7]) == float(ours[8]) == 1.0  # pagedserve over itself
        assert by_server[(c, "llamacpp")][2].startswith("unavailable: needs a GGUF")  # the tiny model has none
        assert by_server[(c, "vllm")][2].startswith(("unavailable: not installed", "unavailable: needs AVX-512"))
    assert "lean loop (plain torch" in stdout and "matmul ceiling at C=64" in stdout
    assert "llama.cpp server" in stdout and "--split-kv" in stdout  # how each peer is configured
    ceiling = [line for line in stdout.splitlines() if line.startswith("  C=3: ")]
    assert len(ceiling) == 1 and "with the" in ceiling[0] and "outside the forward" in ceiling[0]


def test_missing_peer_venvs_are_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("LOADGEN_PEERS_VENV", str(tmp_path / "none"))
    monkeypatch.setenv("LOADGEN_VLLM_VENV", str(tmp_path / "none"))
    args = serve_vs_peers.parse_args(["--quick"])
    assert serve_vs_peers.unavailable("llamacpp", args).startswith("not installed")
    assert serve_vs_peers.unavailable("pagedserve", args) is None
    if "avx512f" in vllm_server.cpu_flags():
        assert serve_vs_peers.unavailable("vllm", args).startswith("not installed")
    else:  # no install could help: said first
        assert serve_vs_peers.unavailable("vllm", args).startswith("needs AVX-512")
        assert "AVX-512" in vllm_server.available(Path(sys.executable))


def test_lean_loop_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = torch.randint(100, 49152, (3, 9), generator=torch.Generator().manual_seed(1))
    lean = LeanDecoder(tiny_model_dir, torch.float32, batch=3, max_len=16)
    seq, tokens, pos = prompt, prompt, 0
    with torch.no_grad():
        for _ in range(4):  # the prefill, then decode steps through the cache
            ours = lean.logits(tokens, pos)
            torch.testing.assert_close(ours, hf(seq).logits[:, -1], rtol=1e-4, atol=1e-4)
            pos, tokens = pos + tokens.shape[1], ours.argmax(-1, keepdim=True)
            seq = torch.cat([seq, tokens], dim=1)



def test_each_point_gets_its_own_requests():
    """A server that keeps its prefix cache across points (pagedserve) must not meet an earlier
    point's prompts again: the points' slices of the trace follow each other without overlap."""
    args = serve_vs_peers.parse_args(["--concurrency", "1", "16", "64"])
    offsets = serve_vs_peers.point_offsets(args.concurrency, args)
    spans = [(offsets[c], offsets[c] + serve_vs_peers.point_requests(c, args)) for c in args.concurrency]
    assert spans[0][0] == 0
    assert all(end == start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert all(end - start >= c for (start, end), c in zip(spans, args.concurrency, strict=True))


def test_engine_counters_sum_labels_and_give_the_computed_prompt_share():
    page = "\n".join([
        "# HELP pagedserve_prompt_tokens_total Prompt tokens processed",
        "pagedserve_prompt_tokens_total 900.0",
        "pagedserve_prompt_tokens_created 1.7e9",
        "pagedserve_prefix_cache_hits_total 300.0",
        'pagedserve_engine_prefix_cache_hits_total{engine="a"} 300.0',  # the same hits per engine: not summed in
        "pagedserve_generation_tokens_total 600.0",
        'pagedserve_decode_step_seconds_total{replica="s0"} 2.0',
        'pagedserve_decode_step_seconds_total{replica="s1"} 2.0',
        "pagedserve_decode_forward_seconds_total 3.8",
    ])
    after = engine_counters.parse(page)
    before = dict.fromkeys(engine_counters.COUNTERS, 0.0)
    assert after[engine_counters.STEPS] == 0.0 and after[engine_counters.STEP_SECONDS] == 4.0
    assert engine_counters.computed_prompt_per_output(before, after) == pytest.approx(1.0)  # (900 - 300) / 600
    assert engine_counters.outside_share(before, after) == pytest.approx(0.05)
    # async scheduling: a step's interval from the previous result may be a little shorter than its
    # forward, so with nothing outside the forwards the sums differ by that skew: 0, not negative
    skewed = {**after, engine_counters.FORWARD_SECONDS: 4.1}
    assert engine_counters.outside_share(before, skewed) == 0.0


def test_the_ceiling_with_prompts_counts_them_without_the_lm_head():
    gemm = [{"rows": 64, "gflops": 100.0, "matmul_params": 1000}, {"rows": 1024, "gflops": 200.0, "matmul_params": 1000}]
    assert machine.workload_ceiling(gemm, head=200, prompt_per_output=0.0) == pytest.approx(100e9 / 2000)
    # per output token: 2*1000 FLOPs at 100 GFLOP/s, plus 1.5 prompt tokens of 2*800 FLOPs at 200 GFLOP/s
    expected = 1 / (2000 / 100e9 + 1.5 * 1600 / 200e9)
    assert machine.workload_ceiling(gemm, head=200, prompt_per_output=1.5) == pytest.approx(expected)
    assert machine.workload_ceiling(gemm, head=200, prompt_per_output=1.0, rows=16) is None
