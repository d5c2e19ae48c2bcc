"""OpenAI's Responses API through the openai SDK on the tiny random Llama: whole, streamed
(`responses.stream` and `stream=True`), async; a function-tool round trip (a forced call, then
its function_call_output); `text.format` json_schema output that validates; previous_response_id;
retrieve and delete; `store: false` keeps nothing."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-llama"
# an enum, not a free string: the grammar lets a raw control character into a string (a finding of
# its own, services/tokenizer's JSON grammar), which json.loads then refuses
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER,
        "strict": True}
CITY = {"type": "object", "properties": {"name": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "size": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "size"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def test_whole_response_then_retrieve_and_delete(client):
    resp = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                   max_output_tokens=6, temperature=0, metadata={"run": "1"})
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.output_text == item.content[0].text and resp.output_text
    assert resp.usage.output_tokens == 6 and resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.instructions == "Be brief." and resp.metadata == {"run": "1"} and resp.max_output_tokens == 6
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)


def test_store_false_keeps_nothing(client):
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert resp.output_text is not None and resp.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(resp.id)
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="again", previous_response_id=resp.id, max_output_tokens=2)


def test_stream_helper_and_raw_events_match_the_whole_answer(client):
    args = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}],
                max_output_tokens=8, temperature=0)
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:  # cut by max_output_tokens: it ends with response.incomplete
        seen = list(stream)
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert seen[-1].type == "response.incomplete"
    assert "".join(deltas) == seen[-1].response.output_text == whole.output_text
    events = list(client.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == whole.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == whole.output_text


def test_async_client(tiny_server):
    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            resp = await c.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
            async with c.responses.stream(model=MODEL, input="Hi", max_output_tokens=4, temperature=0) as stream:
                seen = [e async for e in stream]
            return resp, seen[-1].response
    resp, final = asyncio.run(run())
    assert resp.output_text == final.output_text and resp.output_text


@pytest.mark.parametrize("streamed", [False, True])
def test_function_tool_round_trip(client, streamed):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    args = dict(model=MODEL, input=ask, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=40, temperature=0)
    if streamed:
        with client.responses.stream(**args) as stream:
            arg_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            resp = stream.get_final_response()
    else:
        resp = client.responses.create(**args)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    if streamed:
        assert "".join(arg_deltas) == call.arguments
    answer = client.responses.create(model=MODEL, max_output_tokens=5, temperature=0, tools=[TOOL], input=[
        *ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}], tool_choice="none")
    assert answer.output[0].type == "message" and answer.usage.input_tokens > resp.usage.input_tokens
    # the same turn through previous_response_id: the stored call is part of the prompt
    chained = client.responses.create(model=MODEL, previous_response_id=resp.id, max_output_tokens=5, temperature=0,
                                      tools=[TOOL], tool_choice="none", input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert chained.usage.input_tokens == answer.usage.input_tokens and chained.output_text == answer.output_text


def test_required_tool_choice_streams_the_call_at_the_end(client):
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[TOOL], tool_choice="required",
                                          max_output_tokens=60, temperature=0, stream=True))
    final = events[-1].response
    calls = [i for i in final.output if i.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]


def test_json_schema_output_validates(client):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    resp = client.responses.create(model=MODEL, input="A city", text=fmt, max_output_tokens=60, temperature=0)
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), CITY)
    obj = client.responses.create(model=MODEL, input="JSON", text={"format": {"type": "json_object"}},
                                  max_output_tokens=60, temperature=0)
    assert obj.status != "completed" or isinstance(json.loads(obj.output_text), dict)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens


def test_fields_not_built_are_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", background=True)
    assert err.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools"
