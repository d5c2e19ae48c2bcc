"""OpenAI request validation (accepted shapes, clear 400s) and response bodies."""

from __future__ import annotations

import json

import pytest

from services.gateway.limits import DEFAULT_LIMITS
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.errors import ApiError
from services.gateway.openai.fields import DEFAULT_COMPLETION_MAX_TOKENS
from services.gateway.openai.request import parse_json
from services.gateway.openai.responses import ResponseBuilder, new_request_id, usage
from shared.messages import ChatMessage, SamplingParams

NAMES = {"SmolLM2-135M-Instruct", "smollm2"}


def completion(**body):
    return parse_completion({"model": "smollm2", "prompt": "Hi", **body}, NAMES)


def chat(**body):
    return parse_chat({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], **body},
                      NAMES)


def error(fn, **body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(**body)
    err = info.value
    assert err.status == 400
    payload = err.body()["error"]
    assert payload["type"] == "invalid_request_error" and payload["message"]
    return err


# --- accepted shapes ------------------------------------------------------------------


def test_completion_defaults():
    req = completion()
    assert req.kind == "completion" and req.prompt == "Hi" and req.prompt_token_ids is None
    assert req.params == SamplingParams(max_tokens=DEFAULT_COMPLETION_MAX_TOKENS)
    assert not req.stream and not req.include_usage


def test_completion_all_fields():
    req = completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=20, seed=3, stop="\n", stop_token_ids=[5],
        ignore_eos=True, include_stop_str_in_output=True, stream=True, stream_options={"include_usage": True},
        n=1, user="someone", presence_penalty=0, logprobs=None, unknown_extra={"x": 1}, return_token_ids=True,
    )
    assert req.params == SamplingParams(
        max_tokens=7, temperature=0.0, top_p=0.5, top_k=20, seed=3, stop=["\n"], stop_token_ids=[5],
        ignore_eos=True, include_stop_str_in_output=True,
    )
    assert req.stream and req.include_usage and req.return_token_ids


@pytest.mark.parametrize(
    "prompt, text, ids",
    [
        ("hello", "hello", None),
        (["hello"], "hello", None),
        ([1, 2, 3], None, [1, 2, 3]),
        ([[4, 5]], None, [4, 5]),
    ],
)
def test_prompt_shapes(prompt, text, ids):
    req = completion(prompt=prompt)
    assert (req.prompt, req.prompt_token_ids) == (text, ids)
    gen = req.to_generate("cmpl-1")
    assert gen.request_id == "cmpl-1" and gen.prompt == text and gen.prompt_token_ids == ids


def test_model_may_be_omitted():
    assert parse_completion({"prompt": "x"}, NAMES).prompt == "x"


def test_chat_content_shapes():
    req = chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert req.kind == "chat"
    assert req.messages == [
        ChatMessage("system", "Be brief."), ChatMessage("user", "a\nb"), ChatMessage("assistant", ""),
    ]


def test_chat_max_completion_tokens_wins():
    assert chat(max_tokens=5).params.max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).params.max_tokens == 9


# --- rejections -----------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe\x00"])
def test_malformed_json(raw):
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert info.value.status == 400


@pytest.mark.parametrize("number", ["-21545974458559721472", str(2**64), str(-(2**63) - 1)])
def test_an_integer_beyond_64_bits_anywhere_in_the_body_is_a_400(number):
    """msgpack, the stages' wire format, carries no such integer: refused where the body is read."""
    raw = ('{"messages": [], "tools": [{"input_schema": {"x": ' + number + '}}]}').encode()
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert info.value.status == 400 and "64 bits" in info.value.message


def test_integers_of_64_bits_and_big_floats_are_taken():
    body = parse_json(f'{{"a": {2**64 - 1}, "b": {-(2**63)}, "c": 1e300}}'.encode())
    assert body == {"a": 2**64 - 1, "b": -(2**63), "c": 1e300}


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        completion(model="gpt-4")
    err = info.value
    assert err.status == 404 and err.body()["error"]["type"] == "invalid_request_error"
    assert err.param == "model" and "gpt-4" in err.message and err.code == "model_not_found"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [str(i) for i in range(DEFAULT_LIMITS.max_stop + 1)]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stream": 1}, "stream"),
        ({"return_token_ids": "yes"}, "return_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": "usage"}, "stream_options"),
        ({"n": 17}, "n"),
        ({"n": 3, "use_beam_search": True, "beam_width": 2}, "beam_width"),
        ({"n": 0}, "n"),
        ({"echo": "yes"}, "echo"),
        ({"logprobs": 30}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a", [1, -1]]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
    ],
)
def test_completion_rejections(body, param):
    assert error(completion, **body).param == param


def test_n_and_beam_search_fields_become_sampling_params():
    assert "between 1 and 16" in error(completion, n=40).message
    params = completion(n=4).params
    assert params.n == 4 and not params.use_beam_search
    beam = completion(n=2, use_beam_search=True, beam_width=3, length_penalty=0.5).params
    assert (beam.n, beam.use_beam_search, beam.beam_width, beam.length_penalty) == (2, True, 3, 0.5)
    assert completion(use_beam_search=True).params.beam_width == 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": ["x"]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_chat_rejections(body, param):
    assert error(chat, **body).param == param


# --- responses ------------------------------------------------------------------------


def test_ids():
    assert new_request_id("completion").startswith("cmpl-")
    assert new_request_id("chat").startswith("chatcmpl-")
    assert new_request_id("chat") != new_request_id("chat")


def test_completion_bodies():
    out = ResponseBuilder("completion", "cmpl-1", "m")
    full = out.full([("text", "length", [])], usage(3, 4))
    assert full["object"] == "text_completion" and full["id"] == "cmpl-1" and full["model"] == "m"
    assert full["choices"] == [{"index": 0, "text": "text", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chunk = out.chunk("te")
    assert chunk["choices"][0]["text"] == "te" and "usage" not in chunk
    json.dumps(full), json.dumps(chunk)


def test_token_ids_only_when_asked():
    plain = ResponseBuilder("completion", "cmpl-1", "m")
    assert "token_ids" not in plain.full([("t", "stop", [5])], usage(1, 1))["choices"][0]
    out = ResponseBuilder("chat", "chatcmpl-1", "m", return_token_ids=True)
    assert out.full([("t", "stop", [5, 2])], usage(1, 2))["choices"][0]["token_ids"] == [5, 2]
    assert out.chunk("t", token_ids=[7])["choices"][0]["token_ids"] == [7]


def test_chat_bodies_with_usage_chunks():
    out = ResponseBuilder("chat", "chatcmpl-1", "m", include_usage=True)
    full = out.full([("hi", "stop", [])], usage(1, 1))
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    first = out.chunk("", role=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert out.chunk("x")["choices"][0]["delta"] == {"content": "x"}
    last = out.chunk("", "stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    tail = out.usage_chunk(usage(1, 2))
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 3


# --- float fields: finite and in a sane range (issue 10, item 1) ----------------------------

_FLOAT_FIELDS = ["temperature", "top_p", "length_penalty", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"]


@pytest.mark.parametrize("name", _FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 2000, -2000,
                                   "1.0", True, False, [1.0], {"v": 1}])
def test_every_float_field_rejects_non_finite_huge_and_wrong_types(name, value):
    body = {name: value, "use_beam_search": True} if name == "length_penalty" else {name: value}
    err = error(completion, **body)
    assert err.param == name
    json.dumps(err.body(), allow_nan=False)  # the error body itself is plain JSON


def test_length_penalty_that_overflowed_the_beam_score_is_refused():
    err = error(completion, use_beam_search=True, beam_width=2, length_penalty=2000, ignore_eos=True)
    assert err.param == "length_penalty" and "between" in err.message
    assert completion(use_beam_search=True, length_penalty=-10).params.length_penalty == -10
    assert completion(use_beam_search=True, length_penalty=10).params.length_penalty == 10


def test_sane_float_values_still_pass():
    assert completion(temperature=100).params.temperature == 100
    assert completion(temperature=1e-9).params.temperature == 1e-9
    assert completion(top_p=1e-9).params.top_p == 1e-9
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0), ("repetition_penalty", 1.0)):
        assert completion(**{name: neutral}).params == completion().params
    assert error(completion, temperature=100.5).param == "temperature"
