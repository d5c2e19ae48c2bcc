"""The sampler's batched logits processors against transformers' own processors, on the same logits."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
)

from services.executor.logits_processors import History, apply_processors
from services.executor.sampler import Sampler, draw_seed
from shared.messages import SeqSampling

VOCAB = 64
PLAIN = SeqSampling(1.0, 1.0, 0, None)


def with_(**fields) -> SeqSampling:
    return msgspec.structs.replace(PLAIN, **fields)


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_repetition_penalty_equals_transformers():
    logits = logits_for(3)
    prompts, outputs = [ids(1, 9), ids(2, 4), ids(3, 1)], [ids(4, 5), [], ids(5, 12)]
    penalties = [1.3, 0.7, 2.0]
    params = [with_(repetition_penalty=r) for r in penalties]
    got = apply_processors(logits, params, [len(o) for o in outputs],
                           [History(p, o) for p, o in zip(prompts, outputs, strict=True)])
    for i, r in enumerate(penalties):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(r)(input_ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], want)


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = logits_for(2, seed=1)
    prompt, output = ids(6, 10), [5, 5, 5, 9, 9, 11]
    params = [with_(presence_penalty=0.5, frequency_penalty=0.25), with_(presence_penalty=-1.0)]
    got = apply_processors(logits, params, [6, 6], [History(prompt, output), History(prompt, output)])
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    for i, p in enumerate(params):  # OpenAI's documented formula
        want = logits[i] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i], want)
    assert torch.equal(got[0][[t for t in prompt if t not in output]],
                       logits[0][[t for t in prompt if t not in output]])


def test_logit_bias_equals_sequence_bias():
    logits = logits_for(2, seed=2)
    bias = [(3, 5.0), (10, -100.0), (VOCAB + 7, 1.0)]  # an id past the vocabulary is dropped
    got = apply_processors(logits, [with_(logit_bias=bias), PLAIN], [0, 0])
    want = SequenceBiasLogitsProcessor({(3,): 5.0, (10,): -100.0})(torch.tensor([[1]]), logits[:1].clone())
    torch.testing.assert_close(got[:1], want)
    assert torch.equal(got[1], logits[1])  # the other row is untouched


def test_min_tokens_equals_min_new_tokens():
    logits = logits_for(1, seed=3)
    eos = [2, 7]
    p = with_(min_tokens=3, min_tokens_mask=eos)
    proc = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=4, min_new_tokens=3, eos_token_id=eos)
    for produced in range(5):
        got = apply_processors(logits, [p], [produced])
        want = proc(torch.zeros(1, 4 + produced, dtype=torch.long), logits.clone())
        torch.testing.assert_close(got, want)


def test_allowed_token_ids_suppress_every_other_token():
    logits = logits_for(1, seed=4)
    allowed = [1, 8, 33]
    got = apply_processors(logits, [with_(allowed_token_ids=allowed)], [0])
    suppress = [t for t in range(VOCAB) if t not in allowed]
    want = SuppressTokensLogitsProcessor(suppress)(torch.tensor([[0]]), logits.clone())
    torch.testing.assert_close(got, want)
    draws = {Sampler(seed=s)(logits, [with_(allowed_token_ids=allowed)], [0])[0] for s in range(30)}
    assert draws <= set(allowed)


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 2.0)])
def test_min_p_equals_transformers(min_p, temperature):
    logits = logits_for(2, seed=5)
    params = [with_(min_p=min_p, temperature=temperature), with_(temperature=temperature)]
    probs = Sampler._probabilities(logits.clone(), params)
    scaled = TemperatureLogitsWarper(temperature)(None, logits.clone())
    want = MinPLogitsWarper(min_p)(None, scaled[:1].clone()).softmax(dim=-1)
    torch.testing.assert_close(probs[:1], want)
    torch.testing.assert_close(probs[1:], scaled[1:].softmax(dim=-1))  # its neighbour is untouched


def test_no_processor_leaves_the_logits_alone_and_seeded_draws_unchanged():
    logits = logits_for(3, seed=6)
    params = [with_(seed=11, temperature=0.9), PLAIN, with_(seed=11, temperature=0.9, top_k=5)]
    assert apply_processors(logits, params, [0, 0, 0]) is logits
    out = Sampler(seed=0)(logits, params, [4, 0, 4])
    gen = torch.Generator().manual_seed(draw_seed(11, 4))
    assert out[0] == int(torch.multinomial((logits[0] / 0.9).softmax(-1), 1, generator=gen))


def test_greedy_rows_see_the_processors_too():
    logits = logits_for(1, seed=7)
    best = int(logits.argmax())
    greedy = with_(temperature=0.0)
    assert Sampler()(logits, [greedy], [0]) == [best]
    assert Sampler()(logits, [with_(temperature=0.0, logit_bias=[(best, -1000.0)])], [0]) != [best]
    banned = with_(temperature=0.0, frequency_penalty=2.0, presence_penalty=50.0)
    assert Sampler()(logits, [banned], [1], [History([], [best])]) != [best]


def test_penalized_row_without_history_is_an_error():
    with pytest.raises(ValueError, match="history"):
        apply_processors(logits_for(1), [with_(presence_penalty=1.0)], [0])


def test_bad_words_equal_no_bad_words():
    from transformers import NoBadWordsLogitsProcessor

    logits = logits_for(3, seed=8)
    words = [[5], [7, 9], [1, 2, 3]]
    outputs = [[4, 7], [1, 2], [9, 9]]  # row 0 ends with 7 (bans 9), row 1 with 1, 2 (bans 3)
    params = [with_(bad_words_ids=words)] * 3
    got = apply_processors(logits, params, [2, 2, 2], [History([], o) for o in outputs])
    proc = NoBadWordsLogitsProcessor(words, eos_token_id=None)
    for i, out in enumerate(outputs):
        want = proc(torch.tensor([out]), logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], want)


def test_a_row_that_allows_no_token_is_never_sampled_and_spares_the_batch():
    """Every token masked (e.g. a grammar and allowed_token_ids that exclude each other): that
    row comes back -1, greedy or not (never token 0, the argmax of all -inf); an infinite
    logit still takes its greedy pick; the other rows sample as before."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    logits[0] = float("-inf")  # nothing allowed, sampled row
    logits[1, 7] = float("inf")  # an infinite bias
    logits[4] = float("-inf")  # nothing allowed, greedy row
    greedy = SeqSampling(0.0, 1.0, 0, seed=None)
    params = [PLAIN, PLAIN, SeqSampling(1.0, 1.0, 0, seed=5), SeqSampling(0.7, 0.9, 10, seed=6), greedy, greedy]
    out = Sampler(seed=0).sample(logits.clone(), params, [0] * 6)
    assert out[0] == -1 and out[1] == 7 and out[4] == -1
    assert out[5] == int(logits[5].argmax())
    alone = Sampler(seed=0).sample(logits[2:4].clone(), params[2:4], [0, 0])
    assert out[2:4] == alone  # seeded rows unchanged by their neighbours' trouble
    assert Sampler(seed=0).sample(logits.clone(), params, [0] * 6, skip={2, 5})[2::3] == [-1, -1]
