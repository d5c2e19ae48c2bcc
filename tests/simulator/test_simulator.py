"""`pagedserve simulate`: the workload it draws, its clock and time averages, and a
short run through the command line that must rank the policies as the paper does."""

import json
import random
import statistics

import pytest

from services import cli
from services.scheduler.scheduler import ScheduledChunk
from services.scheduler.sequence import Sequence
from services.simulator.engine import SimConfig, simulate
from services.simulator.step_time import StepTimeModel
from services.simulator.workload import DATA_FILE, TraceRequest, load_histograms, make_trace
from shared.messages import SamplingParams
from tests.helpers import ROOT

SHARED_DATA = ROOT.parent / "shared" / "data" / DATA_FILE.name


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="no shared/data beside the repository")
def test_bundled_histograms_are_the_shared_data_unchanged():
    assert DATA_FILE.read_bytes() == SHARED_DATA.read_bytes()


@pytest.mark.parametrize("dataset, prompt_mean, output_mean", [("sharegpt", 161.4, 338.0), ("alpaca", 19.6, 58.6)])
def test_length_samples_follow_the_histograms(dataset, prompt_mean, output_mean):
    prompts, outputs = load_histograms(dataset)
    rng = random.Random(1)
    for hist, mean in ((prompts, prompt_mean), (outputs, output_mean)):
        draws = [hist.sample(rng) for _ in range(20000)]
        assert min(draws) >= 1 and max(draws) <= round(hist.edges[-1])
        assert statistics.mean(draws) == pytest.approx(mean, rel=0.04)  # the README's bin-midpoint means


def test_trace_is_seeded_poisson_and_fits_the_context():
    trace = make_trace("sharegpt", 5.0, 400.0, seed=3, max_model_len=1024)
    assert trace == make_trace("sharegpt", 5.0, 400.0, seed=3, max_model_len=1024)
    assert trace != make_trace("sharegpt", 5.0, 400.0, seed=4, max_model_len=1024)
    arrivals = [t.arrival for t in trace]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 400
    assert len(trace) == pytest.approx(2000, rel=0.1)
    gaps = [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)]
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.15)  # exponential
    assert all(t.prompt_len + t.output_len <= 1024 for t in trace)  # redrawn, not clipped
    assert max(t.prompt_len + t.output_len for t in trace) > 900


def test_step_time_counts_prefill_tokens_and_decoding_sequences():
    model = StepTimeModel(fixed_s=1.0, prefill_token_s=0.1, decode_seq_s=0.01, context_token_s=0.001)
    prefill = Sequence("p", [5] * 100, SamplingParams(), frozenset(), 0.0)
    decode = Sequence("d", [5] * 20, SamplingParams(), frozenset(), 0.0, output_token_ids=[6, 6])
    decode.num_computed_tokens = 21
    chunks = [ScheduledChunk(prefill, 60), ScheduledChunk(decode, 1)]
    assert model(chunks) == pytest.approx(1.0 + 60 * 0.1 + 0.01 + 22 * 0.001)


def test_clock_and_time_averages_follow_one_request():
    model = StepTimeModel(fixed_s=0.5, prefill_token_s=0.0, decode_seq_s=0.0, context_token_s=0.0)
    cfg = SimConfig(kv_slots=256, duration_s=10.0, block_size=16, step_time=model)
    result = simulate("paged", [TraceRequest(arrival=1.0, prompt_len=20, output_len=6)], cfg)
    # six steps of 0.5 s (the prompt's yields the first token), then idle to the end
    assert (result.num_finished, result.num_steps) == (1, 6)
    assert result.mean_batched_requests == pytest.approx(3.0 / 10.0)
    assert result.mean_normalized_latency_s == pytest.approx(3.0 / 6)
    # 20 prompt tokens for the first 0.5 s after their step, then one more per step
    # (held until the next step ends); the pool is empty otherwise
    assert result.usage.token_states == pytest.approx(sum(0.5 * n for n in (20, 21, 22, 23, 24)) / 10.0)
    assert result.usage.total == pytest.approx(256)


def test_short_simulation_ranks_the_policies_like_the_paper(capsys):
    argv = ["simulate", "--dataset", "sharegpt", "--kv-slots", "6000", "--request-rate", "2",
            "--duration", "40", "--seed", "0", "--policy", "all", "--json"]
    assert cli.main(argv) == 0
    results = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}
    order = ["paged", "reserve-oracle", "reserve-pow2", "reserve-max"]
    assert sorted(results) == sorted(order)
    keys = ("token_state_share", "reserved_share", "internal_frag_share", "external_frag_share")
    for r in results.values():
        assert {"policy", *keys, "mean_batched_requests", "free_share", "num_finished"} <= set(r)
        assert sum(r[k] for k in keys) == pytest.approx(1.0)
        assert all(0 <= r[k] <= 1 for k in keys)
    for key in ("token_state_share", "mean_batched_requests"):
        values = [results[p][key] for p in order]
        assert values == sorted(values, reverse=True) and len(set(values)) == 4, (key, values)
    assert results["paged"]["token_state_share"] >= 0.96
    assert results["paged"]["external_frag_share"] == 0
    assert results["reserve-oracle"]["internal_frag_share"] == 0  # slot-granular, exact lengths
    assert all(results[p]["num_preemptions"] == 0 for p in order[1:])


def test_table_prints_the_papers_figures_beside_ours(capsys):
    argv = ["simulate", "--dataset", "sharegpt", "--request-rate", "2", "--duration", "10", "--policy", "paged"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    paged_row = next(line for line in out.splitlines() if line.startswith("paged"))
    assert "96.3%" in paged_row and "30.42" in paged_row
    assert "memory in use" in out


def table_rows(out: str) -> dict[str, list[str]]:
    """policy -> the cells of its row in `simulate`'s table."""
    policies = ("reserve-max", "reserve-pow2", "reserve-oracle", "paged")
    return {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in ([p] for p in policies)}


@pytest.mark.parametrize("dataset, rate, duration, fig13", [
    ("sharegpt", "2", "60", ("7.00", "9.81", "13.62", "30.42")),
    ("alpaca", "30", "30", ("7.00", "43.24", "72.75", "132.44")),
])
def test_printed_figures_2_and_13_rank_max_pow2_oracle_paged(capsys, dataset, rate, duration, fig13):
    """The table at the paper's pool (15.7K slots) and rates, shortened: buddy placement,
    the paper's figures beside ours, and both figures in the paper's order."""
    argv = ["simulate", "--dataset", dataset, "--kv-slots", "15700", "--request-rate", rate,
            "--duration", duration, "--seed", "0", "--policy", "all"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "placed by buddy" in out.splitlines()[0]
    rows = table_rows(out)
    order = ["reserve-max", "reserve-pow2", "reserve-oracle", "paged"]
    assert [rows[p][10] for p in order] == list(fig13)  # Figure 13 beside ours
    token_states = [float(rows[p][1].rstrip("%")) for p in order]
    batched = [float(rows[p][9]) for p in order]
    assert token_states == sorted(token_states) and len(set(token_states)) == 4, token_states
    assert batched == sorted(batched) and len(set(batched)) == 4, batched
    shares = {p: [float(c.rstrip("%")) for c in rows[p][1:9:2]] for p in order}
    assert all(sum(s) == pytest.approx(100, abs=0.3) for s in shares.values())
    assert shares["paged"][3] == 0 and shares["reserve-oracle"][2] == 0  # no external / no internal
    # the buddy allocator's holes and rounding: most of Pow2's and Oracle's waste is external
    for p in ("reserve-pow2", "reserve-oracle"):
        assert shares[p][3] > max(shares[p][2], shares["reserve-max"][3]), (p, shares[p])
    if dataset == "sharegpt":  # Figure 2 beside ours
        assert [rows["reserve-pow2"][i] for i in (2, 4, 6, 8)] == ["26.8%", "17.9%", "13.6%", "41.6%"]
