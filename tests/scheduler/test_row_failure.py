"""Failure belongs to one row (issue 19): a sequence whose own computation in a step fails
(constraints that leave no token, a grammar its history breaks, a prompt score that
cannot be taken) is listed in `StepResult.failed` and sampled -1, and the step's other
rows are exactly what they are in a step without it. Run on the tiny random Llama, which
speaks SmolLM2's tokenizer, so the grammar rows run xgrammar for real."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from services.executor.logits_processors import History, apply_processors
from services.executor.model_runner import ModelRunner
from services.executor.previous_tokens import PreviousTokens
from services.scheduler.validation import constraints_problem
from shared.messages import (
    PREVIOUS_TOKEN,
    ExecuteStep,
    SamplingParams,
    ScheduledSeq,
    SeqSampling,
    StructuredOutput,
)

pytest.importorskip("xgrammar")

BLOCK = 16
EOS = 2
GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)
PROMPT = [1, 504, 3458, 282, 253, 1345]


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=32, seed=0)


@pytest.fixture(scope="module")
def yes(tiny_model_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_model_dir).encode("yes")


def seq(rid: str, block: int, sampling: SeqSampling, out: list[int] = (), prompt=PROMPT, **kw) -> ScheduledSeq:
    """A whole prompt (and the output so far) computed in one chunk, sampling the next token."""
    tokens = [*prompt, *out]
    return ScheduledSeq(rid, tokens, 0, [block], [block * BLOCK + p for p in range(len(tokens))], True, len(out),
                        sampling, output_token_ids=list(out), prompt_token_ids=list(prompt), **kw)


def good_rows() -> list[ScheduledSeq]:
    return [
        seq("greedy", 0, GREEDY),
        seq("seeded", 1, SeqSampling(0.8, 0.95, 50, seed=7, logprobs=2)),
        seq("allowed", 2, SeqSampling(0.0, 1.0, 0, None, allowed_token_ids=[10, 20, 30], logprobs=0)),
        seq("regex", 3, SeqSampling(1.0, 1.0, 0, seed=3, structured=StructuredOutput("regex", "[a-z]{1,8}"))),
        seq("penalized", 4, SeqSampling(0.0, 1.0, 0, None, presence_penalty=1.5, repetition_penalty=1.3),
            out=[504, 3458]),
    ]


def bad_rows(yes: list[int]) -> dict[str, tuple[ScheduledSeq, int]]:
    """Rows whose own computation fails, with the status they must fail with."""
    return {
        # the finding's first request: one allowed token, which min_tokens masks (a sampled row)
        "allowed-vs-min": (seq("allowed-vs-min", 8, SeqSampling(1.0, 1.0, 0, None, allowed_token_ids=[EOS],
                                                                  min_tokens=3, min_tokens_mask=[EOS])), 400),
        # the finding's second: choice ["yes"] done, so only EOS is left, and min_tokens masks it
        "choice-vs-min": (seq("choice-vs-min", 9, SeqSampling(0.0, 1.0, 0, None, min_tokens=6, min_tokens_mask=[EOS],
                                                                structured=StructuredOutput("choice", '["yes"]'),
                                                                logprobs=1), out=yes), 400),
        # a history its grammar refuses (token 0 is no "yes")
        "broken-history": (seq("broken-history", 10, SeqSampling(0.0, 1.0, 0, None,
                                                                  structured=StructuredOutput("regex", "yes")),
                               out=[0]), 500),
        # a prompt position scored against a token outside the vocabulary
        "bad-score": (seq("bad-score", 11, GREEDY, score_targets=[*PROMPT[2:], 10**6], prompt_logprobs=1), 500),
    }


def test_failed_rows_leave_the_others_as_they_are_alone(runner, yes):
    good = good_rows()
    alone = runner.run(ExecuteStep(1, good))
    assert alone.failed == [] and all(t >= 0 for t in alone.sampled)

    bad = bad_rows(yes)
    mixed = [good[0], bad["allowed-vs-min"][0], good[1], good[2], bad["choice-vs-min"][0], good[3],
             bad["broken-history"][0], good[4], bad["bad-score"][0]]
    result = runner.run(ExecuteStep(2, [*(s for s in mixed)]))
    index = {s.request_id: i for i, s in enumerate(mixed)}
    assert {(f.index, f.status) for f in result.failed} == {(index[r], status) for r, (_, status) in bad.items()}
    for f in result.failed:
        assert result.sampled[f.index] == -1
    by_rid = {mixed[f.index].request_id: f.message for f in result.failed}
    assert "min_tokens" in by_rid["allowed-vs-min"] and "allowed_token_ids" in by_rid["allowed-vs-min"]
    assert "structured output" in by_rid["choice-vs-min"] and "min_tokens" in by_rid["choice-vs-min"]
    assert "grammar" in by_rid["broken-history"]
    # the good rows: the same tokens and logprobs as in the step without the bad ones
    assert [result.sampled[index[s.request_id]] for s in good] == alone.sampled
    assert result.sampled[index["allowed"]] in (10, 20, 30)
    # logprobs: seeded, allowed, then the failed choice row's placeholder, in step order
    assert len(result.logprobs) == 3 and result.logprobs[2].token_id == -1
    for got, want in zip([result.logprobs[0], result.logprobs[1]], alone.logprobs, strict=True):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert len(result.prompt_logprobs) == 1 and result.prompt_logprobs[0] == []  # bad-score's placeholder


def test_a_row_with_no_token_is_never_given_one_whatever_its_sampling(runner):
    """Greedy, seeded, unseeded, top-k/top-p/min-p, beams: a row whose processors leave no token
    is failed (never token 0, the argmax of all -inf), and the step goes on."""
    nothing = dict(allowed_token_ids=[EOS], min_tokens=1, min_tokens_mask=[EOS])
    samplings = [SeqSampling(0.0, 1.0, 0, None, **nothing), SeqSampling(1.0, 1.0, 0, 5, **nothing),
                 SeqSampling(0.7, 0.9, 20, None, min_p=0.1, **nothing)]
    rows = [seq(f"r{i}", i, s) for i, s in enumerate(samplings)]
    rows.append(seq("beam", 5, SeqSampling(0.0, 1.0, 0, None, **nothing), num_logprobs=4))
    rows.append(seq("fine", 6, GREEDY))
    result = runner.run(ExecuteStep(3, rows))
    assert [f.index for f in result.failed] == [0, 1, 2, 3] and {f.status for f in result.failed} == {400}
    assert result.sampled[:4] == [-1] * 4 and result.sampled[4] >= 0
    assert len(result.top_logprobs) == 1  # the beam's entry, a placeholder


def test_a_grammar_row_stays_inside_its_grammar_to_the_end(runner, yes):
    """The grammar's last allowed token is EOS: with nothing else masking, it is sampled (the
    scheduler then ends the request); the failed path never touches a fine row."""
    row = seq("done", 0, SeqSampling(1.0, 1.0, 0, None, structured=StructuredOutput("choice", '["yes"]')), out=yes)
    result = runner.run(ExecuteStep(4, [row]))
    assert result.failed == [] and result.sampled == [EOS]


def test_a_step_sent_ahead_runs_on_after_a_row_failed(runner, yes):
    """Async scheduling: the step after the one where a row failed may continue that row with a
    placeholder token. It runs (the failed row with a stand-in token, dropped by the scheduler),
    so the other rows of that step are not refused with it."""
    bad, _ = bad_rows(yes)["allowed-vs-min"]
    good = seq("greedy", 0, GREEDY)
    step = ExecuteStep(5, [good, bad])
    previous = PreviousTokens()
    result = runner.run(step)
    assert [f.index for f in result.failed] == [1]
    previous.record(step, result)
    ahead = [ScheduledSeq(s.request_id, [PREVIOUS_TOKEN], len(s.token_ids), s.block_table, [s.block_table[0] * BLOCK
             + len(s.token_ids)], True, s.output_index + 1, s.sampling) for s in (good, bad)]
    assert previous.fill(ExecuteStep(6, ahead)) is None
    assert ahead[0].token_ids == [result.sampled[0]]
    nxt = runner.run(ExecuteStep(6, ahead))
    assert nxt.sampled[0] >= 0


@pytest.mark.parametrize(("params", "eos", "fields"), [
    (SamplingParams(structured=StructuredOutput("json"), allowed_token_ids=[5]), [EOS], ["allowed_token_ids"]),
    (SamplingParams(structured=StructuredOutput("choice", '["yes"]'), min_tokens=6), [EOS], ["min_tokens"]),
    (SamplingParams(structured=StructuredOutput("json"), ignore_eos=True), [EOS], ["ignore_eos"]),
    (SamplingParams(allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=2), [EOS], ["min_tokens"]),
    (SamplingParams(allowed_token_ids=[5, 6], bad_words_ids=[[5], [6], [9, 9]]), [EOS], ["bad_words"]),
    (SamplingParams(allowed_token_ids=[EOS, 5], bad_words_ids=[[5]], min_tokens=1), [EOS], ["min_tokens", "bad_words"]),
    (SamplingParams(allowed_token_ids=[5, 49152]), [EOS], ["vocabulary"]),
])
def test_admission_refuses_constraints_that_can_leave_no_token(params, eos, fields):
    problem = constraints_problem(params, eos, 49152)
    assert problem is not None and all(f in problem for f in fields), problem


@pytest.mark.parametrize("params", [
    SamplingParams(structured=StructuredOutput("json")),
    SamplingParams(allowed_token_ids=[EOS, 5], min_tokens=2),  # 5 is left
    SamplingParams(allowed_token_ids=[EOS], min_tokens=2, ignore_eos=True),  # EOS is not masked then
    SamplingParams(allowed_token_ids=[5, 6], bad_words_ids=[[5], [9, 6]]),  # 6 only after 9
    SamplingParams(min_tokens=3, bad_words_ids=[[5]]),
])
def test_admission_lets_constraints_that_leave_a_token_through(params):
    assert constraints_problem(params, [EOS], 49152) is None



def test_processors_that_raise_for_one_row_fail_it_alone(runner):
    """The batched processors raise (here: a penalized row sent without its history): they are
    redone row by row, the row that raises fails and allows nothing, the others are processed
    as in a batch without it."""
    raw = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    params = [SeqSampling(0.0, 1.0, 0, None, presence_penalty=1.0), SeqSampling(0.0, 1.0, 0, None, logit_bias=[(3, 5.0)]),
              SeqSampling(0.0, 1.0, 0, None, frequency_penalty=0.5)]
    histories = [History([], [4, 4]), History(), None]  # the third cannot be penalized
    failed: dict[int, tuple[int, str]] = {}
    got = runner._process(raw, params, [2, 0, 1], histories, failed)
    assert list(failed) == [2] and failed[2][0] == 500 and "history" in failed[2][1]
    torch.testing.assert_close(got[:2], apply_processors(raw[:2], params[:2], [2, 0], histories[:2]))
    assert bool((got[2] == float("-inf")).all())
    assert runner._sample(got, params, [2, 0, 1], failed)[2] == -1 and failed[2][0] == 500
