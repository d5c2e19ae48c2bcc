"""Resume (issue 20): a request that comes back with the output its first engine produced
(`TokenizedRequest.output_token_ids`) goes on as if it had never stopped. Run on the
tiny random Llama behind the real scheduler, block manager and the executor's cached
request state: the first k tokens of an uninterrupted run, given back, make the run's
remaining tokens, greedy or seeded at temperature 1; penalties and a grammar read the
whole history; the first delta says what the prefix cache supplied."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.executor.model_runner import ModelRunner
from services.executor.seq_states import SequenceStates
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import SamplingParams, ScheduledSeq, StructuredOutput, TokenDelta

pytest.importorskip("xgrammar")

BLOCK = 16
EOS = 2
PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 2717, 314, 260, 1789, 282, 4537, 30, 378, 3458,
          282, 253, 1345, 30, 2717, 314, 260, 1789, 282, 4537, 30, 378, 504, 3458, 282, 253,
          1345, 30, 2717, 314, 260, 1789, 282, 4537]  # 40 tokens: two full blocks


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=48, seed=0)


class Engine:
    """The scheduler and the real executor's model runner, one step at a time."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                               vocab_size=runner.vocab_size), BlockManager(48, BLOCK))
        self.states = SequenceStates()
        self.sent: dict[str, list[ScheduledSeq]] = {}  # the rows each request got, as scheduled

    def run(self, rid: str, params: SamplingParams, output: list[int] = (), prompt=PROMPT) -> list[TokenDelta]:
        seq = Sequence(rid, list(prompt), params, frozenset({EOS}), 0.0, output_token_ids=list(output),
                       num_resumed_tokens=len(output))
        assert self.sched.check_fits(seq) is None
        self.sched.add_request(seq)
        deltas = []
        while (scheduled := self.sched.schedule()) is not None:
            step, chunks = scheduled
            for row in step.seqs:
                self.sent.setdefault(row.request_id, []).append(
                    ScheduledSeq(row.request_id, list(row.token_ids), row.start_pos, [], [], row.sample,
                                 row.output_index, row.sampling, output_token_ids=list(row.output_token_ids),
                                 output_start=row.output_start))
            self.states.receive(step)
            assert self.states.fill(step) == []
            result = self.runner.run(step)
            assert result.failed == []
            deltas += [d for _, d in self.sched.process_results(chunks, result.sampled, result.top_logprobs,
                                                                 result.logprobs, result.prompt_logprobs)]
            self.sched.check_invariants()
        assert rid not in self.sched.groups
        return deltas


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
                   repetition_penalty=1.4),
    SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, presence_penalty=2.0,
                   min_tokens=6),
], ids=["greedy", "seeded", "penalised", "seeded-penalised-min-tokens"])
def test_a_resumed_request_makes_the_rest_of_the_uninterrupted_run(runner, params):
    engine = Engine(runner)
    whole = engine.run("whole", params)
    full = tokens(whole)
    assert len(full) == 10 and whole[-1].finish_reason == "length"
    assert whole[0].num_cached_tokens == 0
    for k in (1, 4, 9):
        rid = f"resumed-{k}"
        deltas = engine.run(rid, params, full[:k])
        assert tokens(deltas) == full[k:], k  # max_tokens counts the whole output
        assert deltas[-1].finish_reason == "length"
        # the prefix cache holds the full blocks of the runs before (prompt and output): all but
        # the last token's, of which the delta counts the prompt's
        cached = (len(PROMPT) + k - 1) // BLOCK * BLOCK
        assert deltas[0].num_cached_tokens == min(cached, len(PROMPT))
        assert all(d.num_cached_tokens == 0 for d in deltas[1:])
        # recomputed from the start; the first sampled row names output index k and, for the
        # sampling that reads it, carries the whole output history from index 0
        first = next(r for r in engine.sent[rid] if r.sample)
        assert first.output_index == k and first.sampling is not None
        assert engine.sent[rid][0].start_pos == cached
        if params.presence_penalty:
            assert first.output_start == 0 and first.output_token_ids == full[:k]


def test_a_resumed_grammar_request_goes_on_from_where_its_history_leaves_the_grammar(runner, tiny_model_dir):
    """A choice already spelled out by the resumed output leaves only EOS; a regex run resumed
    halfway makes the same rest."""
    yes = AutoTokenizer.from_pretrained(tiny_model_dir).encode("yes")
    engine = Engine(runner)
    choice = SamplingParams(max_tokens=8, temperature=1.0, seed=3, structured=StructuredOutput("choice", '["yes"]'))
    deltas = engine.run("choice", choice, yes)
    assert tokens(deltas) == [EOS] and deltas[-1].finish_reason == "stop"
    first = next(r for r in engine.sent["choice"] if r.sample)
    assert first.output_start == 0 and first.output_token_ids == yes and first.output_index == len(yes)

    regex = SamplingParams(max_tokens=8, temperature=1.0, seed=9, structured=StructuredOutput("regex", "[a-z]{4,12}"))
    full = tokens(engine.run("regex-whole", regex))
    assert len(full) >= 3
    k = len(full) // 2
    assert tokens(engine.run("regex-resumed", regex, full[:k])) == full[k:]
