"""The Anthropic Messages API with the real `anthropic` SDK against the tiny random Llama: whole,
streamed (messages.stream and its text_stream) and async messages, count_tokens matching the
usage a message reports, stop_sequences, a tool call round trip (tool_use, then tool_result),
and errors the SDK raises as its typed exceptions."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-llama"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK's create() has no sampling arguments of its own
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def client(tiny_server):
    with anthropic.Anthropic(base_url=tiny_server.url, api_key="x", max_retries=0) as c:
        yield c


def test_a_whole_message(client):
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, system="Be brief.", **GREEDY,
                                 metadata={"user_id": "u1"})
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.usage.output_tokens <= 6
    assert msg.usage.input_tokens > 0 and all(b.type == "text" for b in msg.content)
    count = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    assert count.input_tokens == msg.usage.input_tokens  # the same prompt, counted by the same template


def test_a_streamed_message_matches_the_whole_one(client):
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, **GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in whole.content) == "".join(b.text for b in final.content)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    events = [e.type for e in client.messages.create(model=MODEL, max_tokens=3, messages=ASK, stream=True)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]


def test_an_async_message(tiny_server):
    async def go():
        async with anthropic.AsyncAnthropic(base_url=tiny_server.url, api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(c.messages.create(model=MODEL, max_tokens=4, messages=ASK, **GREEDY)
                                          for _ in range(2)))

    first, second = asyncio.run(go())
    assert first.content == second.content and first.usage.output_tokens <= 4


def test_stop_sequences_end_the_message(client):
    # the random model's greedy text (EOS ignored, so there is some), then stop at a piece of it:
    # a visible one where there is one (its text is mostly newlines)
    greedy = {"extra_body": {"temperature": 0, "ignore_eos": True}}
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, **greedy)
    text = "".join(b.text for b in whole.content)
    start = next((i for i in range(1, len(text) - 1) if not text[i].isspace()), 1)
    stop = text[start:start + 2]
    msg = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=[stop], **greedy)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop), text
    assert "".join(b.text for b in msg.content) == text[:text.index(stop)]


def test_a_tool_call_round_trip(client):
    first = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=TOOLS, **GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": json.dumps({"temperature": 21})}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=6, messages=history, tools=TOOLS, **GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("max_tokens", "end_turn") and all(b.type == "text" for b in answer.content)
    assert answer.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt
    # greedy: a sampled call of the random model could run past max_tokens and stay text
    with client.messages.stream(model=MODEL, max_tokens=160, messages=ASK, tools=TOOLS, **GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1, repr(final.content[0].text)
    (streamed,) = uses
    assert final.stop_reason == "tool_use" and streamed.name == "get_weather"
    jsonschema.validate(streamed.input, WEATHER)


def test_errors_are_the_sdks_typed_exceptions(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": ASK})  # no max_tokens
    assert info.value.status_code == 400 and info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})


def test_count_tokens_with_an_integer_beyond_64_bits_is_a_400(client):
    # found by schemathesis: msgpack cannot carry it to the tokenizer, which was a 500
    tools = [{"name": "t", "description": "", "input_schema": {"type": "object", "default": {"n": 2**70}}}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model=MODEL, messages=ASK, tools=tools)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:  # and in a generation (schemathesis, CI)
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=tools)
    assert "64 bits" in info.value.body["error"]["message"]
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0  # and it serves on
