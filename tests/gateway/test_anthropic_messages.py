"""The Anthropic Messages API at the gateway: bodies translated into the chat path's request
(system, content blocks, tool_use / tool_result, tool_choice, prefill, refused fields), and over
real HTTP against the stand-in tokenizer and scheduler: a whole message ended by a stop
sequence, a streamed one's events, a tool call parsed into a tool_use block, count_tokens, and
Anthropic-shaped errors with the key sent as x-api-key or bearer."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.admission import Admission
from services.gateway.anthropic.translate import parse_messages_request
from services.gateway.app import Gateway
from services.gateway.health import StageTracker
from services.gateway.metrics import Metrics
from services.gateway.openai.errors import ApiError
from shared.messages import ChatMessage, TokenDelta, TokenizeRequest, TokenizeResult, ToolCall
from tests.gateway.engine_stand_ins import EOS, started, stopped

NAMES = {"tiny"}
KEY = "k3y"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(**body):
    return parse_messages_request({"model": "tiny", "max_tokens": 8, "messages": ASK, **body}, NAMES)


def refused(**body) -> str:
    with pytest.raises(ApiError) as info:
        parse(**body)
    assert info.value.status == 400
    return info.value.param


def test_system_blocks_tool_use_and_tool_result_become_chat_messages():
    req = parse(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                stop_sequences=["END"], temperature=0.5, top_k=3, metadata={"user_id": "u"}, messages=[
                    *ASK,
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"}]},
                        {"type": "text", "text": "And tomorrow?"}]},
                ], tools=[WEATHER])
    p = req.parsed
    assert p.messages == [
        ChatMessage("system", "Be brief.\nBe kind."), ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "Let me look.", [ToolCall("toolu_1", "get_weather", '{"city": "Paris"}')]),
        ChatMessage("tool", "21C", tool_call_id="toolu_1"), ChatMessage("user", "And tomorrow?")]
    assert p.params.stop == ["END"] and req.stop_sequences == ("END",)
    assert (p.params.max_tokens, p.params.temperature, p.params.top_k) == (8, 0.5, 3)
    assert p.chat.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert p.tool_mode.choice == "auto" and p.chat.add_generation_prompt


def test_tool_choice_maps_to_the_chat_modes():
    assert parse(tools=[WEATHER], tool_choice={"type": "any"}).parsed.tool_mode.choice == "required"
    named = parse(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}).parsed
    assert named.tool_mode.named == "get_weather" and json.loads(named.params.structured.spec)["required"] == ["city"]
    assert parse(tools=[WEATHER], tool_choice={"type": "none"}).parsed.tool_mode.choice == "none"
    single = parse(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert single.single_call and json.loads(single.parsed.params.structured.spec)["maxItems"] == 1
    assert refused(tool_choice={"type": "any"}) == "tool_choice"
    assert refused(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}) == "tool_choice"
    assert refused(tools=[{"type": "web_search_20250305", "name": "web_search"}]) == "tools"


def test_a_last_assistant_turn_is_continued():
    chat = parse(messages=[*ASK, {"role": "assistant", "content": "It is"}]).parsed.chat
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["x"]}, "stop"), ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"), ({"suffix": "x"}, "suffix"),  # the chat field policy
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"stop_sequences": "END"}, "stop_sequences"), ({"stop_sequences": ["x"] * 100}, "stop"),
])
def test_what_is_not_built_or_not_valid_is_refused_by_name(body, param):
    assert refused(**body) == param


def test_consecutive_turns_of_a_role_are_one_turn():
    req = parse(messages=[*ASK, {"role": "user", "content": [{"type": "text", "text": "Today."}]}])
    assert req.parsed.messages == [ChatMessage("user", "Weather in Paris?\nToday.")]


def test_output_config_format_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    params = parse(output_config={"format": {"type": "json_schema", "schema": schema}}).parsed.params
    assert params.structured.kind == "json_schema" and json.loads(params.structured.spec) == schema
    assert refused(output_config={"effort": "high"}) == "output_config"
    assert refused(tools=[{**WEATHER, "strict": True}]) == "tools"  # auto calls are not held to the schema
    assert parse(tools=[{**WEATHER, "strict": True}], tool_choice={"type": "any"}).parsed.tool_mode.constrained


def test_neutral_values_pass():
    assert parse(n=1, stop=None, thinking={"type": "disabled"}, parallel_tool_calls=True, cache_control={
        "type": "ephemeral"}, speed="fast", inference_geo="us", service_tier="auto").parsed == parse().parsed
    assert parse(seed=3).parsed.params.seed == 3  # a chat extension field keeps its meaning


# --- over HTTP, against the stand-ins --------------------------------------------------


def run(tmp_path, contexts, tok, body):
    async def go():
        client, reader, (t,), sched, _ = await started(tmp_path, contexts, tok)
        gw = Gateway(client, StageTracker(), Metrics(), "tiny", NAMES, 10.0,
                     admission=Admission(KEY, None, lambda: 0, lambda: None))
        try:
            async with TestClient(TestServer(gw.make_app())) as http:
                return await body(http, t, sched)
        finally:
            await stopped(reader)

    return asyncio.run(go())


async def answer(t, sched, tok, text: str, finish: str | None = "stop"):
    """Answer the next request with text's tokens, then (finish set) an ending EOS."""
    got = await t.answer()
    await sched.take()
    sched.send(TokenDelta(got.request_id, tok.encode(text), 3))
    if finish is not None:
        sched.send(TokenDelta(got.request_id, [EOS], 3, finish, stop_token_id=EOS))
    return got


def post(http, path, body, key=("x-api-key", KEY)):
    return asyncio.get_running_loop().create_task(http.post(path, json=body, headers=dict([key])))


def test_a_whole_message_ended_by_a_stop_sequence(tmp_path, contexts, smollm2_tokenizer):
    async def body(http, t, sched):
        resp = post(http, "/v1/messages", {"model": "tiny", "max_tokens": 20, "messages": ASK,
                                           "stop_sequences": ["STOP"]})
        got = await answer(t, sched, smollm2_tokenizer, "Sunny today STOP and more", finish=None)
        return got, await (await resp).json()

    got, msg = run(tmp_path, contexts, smollm2_tokenizer, body)
    assert got.params.stop == ["STOP"] and got.messages == [ChatMessage("user", "Weather in Paris?")]
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [{"type": "text", "text": "Sunny today "}] and msg["model"] == "tiny"
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "STOP")
    # the tokens up to the one completing the stop sequence count (a delta of several tokens is
    # read one token at a time while stop strings are set), as on the chat path
    ids = smollm2_tokenizer.encode("Sunny today STOP and more")
    upto = next(n for n in range(1, len(ids) + 1) if "STOP" in smollm2_tokenizer.decode(ids[:n]))
    assert upto < len(ids) and msg["usage"] == {"input_tokens": 3, "output_tokens": upto}


def test_a_streamed_message_sends_anthropics_events(tmp_path, contexts, smollm2_tokenizer):
    async def body(http, t, sched):
        resp = post(http, "/v1/messages", {"max_tokens": 20, "messages": ASK, "stream": True},
                    key=("Authorization", f"Bearer {KEY}"))
        await answer(t, sched, smollm2_tokenizer, "Sunny today")
        resp = await resp
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return (await resp.read()).decode()

    frames = [f.split("\n") for f in run(tmp_path, contexts, smollm2_tokenizer, body).strip().split("\n\n")]
    events = [(name[len("event: "):], json.loads(data[len("data: "):])) for name, data in frames]
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == 3 and start["content"] == [] and start["stop_reason"] is None
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Sunny today"}
    delta = events[5][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(smollm2_tokenizer.encode("Sunny today")) + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_becomes_a_tool_use_block(tmp_path, contexts, smollm2_tokenizer, stream):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

    async def body(http, t, sched):
        resp = post(http, "/v1/messages", {"max_tokens": 60, "messages": ASK, "tools": [WEATHER], "stream": stream})
        await answer(t, sched, smollm2_tokenizer, "Looking." + call)
        resp = await resp
        return (await resp.read()).decode() if stream else await resp.json()

    out = run(tmp_path, contexts, smollm2_tokenizer, body)
    if stream:
        events = [json.loads(f.split("\ndata: ")[1]) for f in out.strip().split("\n\n")]
        starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["input"] == {}
        assert starts[1]["name"] == "get_weather" and starts[1]["id"].startswith("toolu_")
        assert deltas[0]["text"] == "Looking." and json.loads(deltas[1]["partial_json"]) == {"city": "Paris"}
        assert events[-2]["delta"]["stop_reason"] == "tool_use"
    else:
        text, use = out["content"]
        assert text == {"type": "text", "text": "Looking."} and out["stop_reason"] == "tool_use"
        assert use["type"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}


def test_count_tokens_is_the_tokenizers_count_of_the_same_prompt(tmp_path, contexts, smollm2_tokenizer):
    async def body(http, t, sched):
        resp = post(http, "/v1/messages/count_tokens", {"model": "tiny", "messages": ASK, "system": "Be brief.",
                                                        "tools": [WEATHER]})
        msg = await t.take(TokenizeRequest)
        t.out.send(TokenizeResult(msg.request_id, [1, 2, 3, 4], 2048))
        return msg, await (await resp).json()

    msg, out = run(tmp_path, contexts, smollm2_tokenizer, body)
    assert out == {"input_tokens": 4}
    assert msg.messages[0] == ChatMessage("system", "Be brief.") and msg.chat.tools[0]["function"]["name"] == "get_weather"


def test_errors_are_anthropic_shaped_with_their_statuses(tmp_path, contexts, smollm2_tokenizer):
    async def body(http, t, sched):
        out = []
        for path, sent, key in [
            ("/v1/messages", {"messages": ASK}, ("x-api-key", KEY)),
            ("/v1/messages", {"model": "other", "max_tokens": 5, "messages": ASK}, ("x-api-key", KEY)),
            ("/v1/messages", {"max_tokens": 5, "messages": ASK}, ("x-api-key", "wrong")),
            ("/v1/messages/count_tokens", {"messages": ASK}, ("Authorization", "Bearer wrong")),
        ]:
            resp = await post(http, path, sent, key)
            out.append((resp.status, await resp.json()))
        resp = await http.post("/v1/messages", data="{}", headers={"x-api-key": KEY, "Content-Type": "text/plain"})
        out.append((resp.status, await resp.json()))
        resp = await http.get("/v1/models", headers={"x-api-key": KEY})  # the key works on every route
        out.append((resp.status, None))
        return out

    got = run(tmp_path, contexts, smollm2_tokenizer, body)
    assert [(status, b and b["error"]["type"]) for status, b in got] == [
        (400, "invalid_request_error"), (404, "not_found_error"), (401, "authentication_error"),
        (401, "authentication_error"), (415, "invalid_request_error"), (200, None)]
    assert all(b["type"] == "error" and b["error"]["message"] for _, b in got[:-1])
    assert "max_tokens" in got[0][1]["error"]["message"] and "x-api-key" in got[2][1]["error"]["message"]


def test_a_named_call_is_a_tool_use_even_with_raw_control_characters():
    from services.gateway.anthropic.message import content_blocks
    from services.gateway.openai.tools import ToolMode

    named = ToolMode("named", ("get_weather",), "get_weather")
    blocks, made = asyncio.run(content_blocks(named, '{"city": "a\x17b"}', False))
    assert made and blocks[0]["input"] == {"city": "a\x17b"}
    cut = asyncio.run(content_blocks(named, '{"city": "Pa', False))  # cut short by max_tokens: text
    assert cut == ([{"type": "text", "text": '{"city": "Pa'}], False)


def test_the_routes_are_in_the_openapi_description_with_anthropic_errors():
    from services.gateway.openai.openapi import openapi_spec

    spec = openapi_spec(["tiny"], secured=True)
    post = spec["paths"]["/v1/messages"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["required"] == ["max_tokens", "messages"]
    assert post["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    assert "/v1/messages/count_tokens" in spec["paths"] and {"apiKey": []} in spec["security"]
    assert spec["components"]["securitySchemes"]["apiKey"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
