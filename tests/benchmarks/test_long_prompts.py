"""serve_vs_peers' long-prompt workload: its points, how each server is configured for 8K contexts,
its table's ratios and the prefill ceiling. No server is started."""

from __future__ import annotations

import pytest

from benchmarks import long_prompts, machine, serve_vs_peers
from loadgen.tokenizer import WordTokenizer


def texts(n: int, words: int = 30) -> list[str]:
    return [" ".join(f"c{i}w{j}" for j in range(words)) for i in range(n)]


def long_args(*extra: str):
    args = serve_vs_peers.parse_args(["--workload", "long", *extra])
    args.model_max_len = 8192
    args.max_input_len = max(high for _, high in long_prompts.ranges(args.long_ranges, 8192, args.output_len))
    return args


def test_each_range_and_concurrency_gets_its_own_prompts_in_range():
    ranges = [(60, 80), (200, 240)]
    plan = long_prompts.points(texts(600), WordTokenizer(), ranges, [1, 4], lambda c: 2 * c + 1, 1, 128)
    assert [p.key for p in plan] == ["60-80 C=1", "60-80 C=4", "200-240 C=1", "200-240 C=4"]
    prompts = [r.prompt for p in plan for r in p.requests]
    assert len(prompts) == len(set(prompts)) == 3 + 9 + 3 + 9
    for p in plan:
        assert len(p.requests) == 2 * p.concurrency + 1 and len(p.warmup) == 1
        low, high = p.prompt_range
        assert all(low <= r.prompt_len <= high and r.output_len == 128 for r in p.requests + p.warmup)
        assert not {r.prompt for r in p.warmup} & set(prompts)


def test_texts_running_out_is_a_clear_error():
    with pytest.raises(SystemExit, match="ran out: 1 of the 3 prompts of 60-80 tokens"):
        long_prompts.points(texts(5), WordTokenizer(), [(60, 80)], [1], lambda c: 3, 0, 8)


def test_long_defaults_and_every_server_takes_prompt_plus_output():
    args = long_args()
    assert args.output_len == 128 and args.concurrency == [1, 8] and args.warmup == 1 and args.no_lean
    assert long_prompts.ranges(args.long_ranges, 8192, 128) == [(1536, 2048), (6144, 8056)]
    assert serve_vs_peers.per_slot_context(args) == 8192  # 8056 + 128 + 64 rounds past the model's 8192
    _, [(_, paged)] = serve_vs_peers.configs("pagedserve", args)
    assert paged == ("--kv-cache-memory", "4GiB")
    llama = serve_vs_peers.configs("llamacpp", args)[1]
    assert [flags[flags.index("--ctx") + 1] for _, flags in llama] == ["8192", str(8 * 8192)]
    _, [(_, vllm)] = serve_vs_peers.configs("vllm", args)
    assert vllm[vllm.index("--max-model-len") + 1] == "8192" and vllm[vllm.index("--max-num-seqs") + 1] == "8"
    short = serve_vs_peers.parse_args(["--quick"])
    short.model_max_len = 8192
    assert serve_vs_peers.configs("pagedserve", short)[1] == [((1, 16), ())]  # its defaults, untouched
    assert "--max-model-len" not in serve_vs_peers.configs("vllm", short)[1][0][1]


def test_table_gives_pagedserve_over_each_server():
    plan = long_prompts.points(texts(100), WordTokenizer(), [(40, 50)], [1], lambda c: 2, 0, 8)
    key = plan[0].key

    def rec(ttft, tpot, prefill):
        return {"ttft_s": {"median": ttft, "p99": 2 * ttft}, "tpot_s": {"median": tpot},
                "prefill_tok_s": {"median": prefill}, "output_tok_s": 10.0, "failed": 0}

    servers = {"pagedserve": {"unavailable": None, "points": {key: rec(1.0, 0.02, 500.0)}},
               "vllm": {"unavailable": None, "points": {key: rec(0.5, 0.04, 2000.0)}},
               "llamacpp": {"unavailable": "not installed", "points": {}}}
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in long_prompts.table(servers, plan).splitlines()
            if line.startswith("| ")][1:]
    by = {r[2]: r for r in rows}
    assert [float(x) for x in by["vllm"][3:11]] == [0.5, 1.0, 40.0, 10.0, 2000.0, 2.0, 0.5, 0.25]
    assert [float(x) for x in by["pagedserve"][8:11]] == [1.0, 1.0, 1.0]
    assert by["llamacpp"][3] == "unavailable: not installed"


def test_prefill_ceiling_counts_attention_and_leaves_out_the_lm_head():
    class Config:
        num_hidden_layers, num_attention_heads, hidden_size = 2, 4, 256

    gemm = [{"rows": 64, "gflops": 50.0, "matmul_params": 1000}, {"rows": 1024, "gflops": 100.0, "matmul_params": 1000}]
    # 2 x (1000 - 200) matmul FLOPs, plus 2 x 2 layers x 4 heads x 64 dims x 10 tokens of attention
    assert machine.prefill_ceiling(gemm, 200, Config, 10) == pytest.approx(100e9 / (1600 + 10240))
    assert machine.prefill_ceiling([], 200, Config, 10) is None


def test_open_loop_points_get_their_own_prompts_and_run_on_the_largest_cs_server():
    args = long_args("--rates", "0.25", "0.5", "--rate-requests", "3")
    plan = long_prompts.points(texts(600), WordTokenizer(), [(60, 80)], [1, 4], lambda c: 2, 1, 128,
                               rates=args.rates, n_rate_requests=args.rate_requests)
    assert [p.key for p in plan] == ["60-80 C=1", "60-80 C=4", "60-80 rate=0.25/s", "60-80 rate=0.5/s"]
    assert [p.load for p in plan] == ["1", "4", "0.25/s", "0.5/s"]
    assert [len(p.requests) for p in plan] == [2, 2, 3, 3]
    prompts = [r.prompt for p in plan for r in p.requests]
    assert len(prompts) == len(set(prompts))
    args.concurrency = [1, 4]
    assert [serve_vs_peers.runs_on(p, (4,), args) for p in plan] == [False, True, True, True]
    assert [serve_vs_peers.runs_on(p, (1,), args) for p in plan] == [True, False, False, False]
    with pytest.raises(SystemExit):
        serve_vs_peers.parse_args(["--rates", "0.5"])  # the short workload has no open-loop points


def test_an_open_loop_point_sends_on_its_rate_and_judges_the_queue():
    from loadgen.targets import Target
    from tests.loadgen.fake_server import FakeConfig, FakeServer

    args = long_args("--rates", "20", "--rate-requests", "24")
    plan = long_prompts.points(texts(600), WordTokenizer(), [(20, 30)], [1], lambda c: 1, 0, 4,
                               rates=args.rates, n_rate_requests=args.rate_requests)[-1]
    with FakeServer(FakeConfig(ttft=0.03, itl=0.002)) as server:
        rec = serve_vs_peers.point(Target(name="fake", url=server.url), plan, args, WordTokenizer())
        arrived = sorted(server.arrivals)
    assert rec["rate"] == 20 and rec["completed"] == 24 and rec["failed"] == 0
    assert rec["open_loop"]["settled"] and rec["open_loop"]["measured_requests"] >= 12
    assert rec["ttft_s"]["median"] == pytest.approx(0.03, abs=0.02)
    # Poisson arrivals at 20/s: 23 gaps of mean 50 ms (~1.15 s), not a burst
    assert 0.3 < arrived[-1] - arrived[0] < 3.0
