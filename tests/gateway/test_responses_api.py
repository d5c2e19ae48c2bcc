"""The Responses API at the gateway, without a model: bodies translated into the chat path's
request (messages, tools, text.format, the field policy), the bounded expiring store, and the
HTTP routes over real sockets against the stand-in tokenizer and scheduler (whole and streamed
answers, tool calls parsed from the text, stored responses continued, retrieved and deleted)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.app import Gateway
from services.gateway.health import StageTracker
from services.gateway.limits import DEFAULT_LIMITS
from services.gateway.metrics import Metrics
from services.gateway.openai.errors import ApiError
from services.gateway.responses_api.request import parse_responses
from services.gateway.responses_api.store import ResponseStore
from shared.messages import ChatMessage, RequestError, TokenDelta, ToolCall
from tests.gateway.engine_stand_ins import EOS, started, stopped

MODELS = {"m"}
GATEWAY = web.AppKey("gateway", Gateway)
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}


def parse(body: dict, store: ResponseStore | None = None):
    return parse_responses({"model": "m", **body}, MODELS, DEFAULT_LIMITS, store or ResponseStore())


def refused(body: dict, store: ResponseStore | None = None) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body, store)
    return err.value


# --- bodies ---------------------------------------------------------------------------------


def test_items_become_the_chat_messages_the_chat_path_reads():
    got = parse({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}, {"type": "input_text", "text": "Now"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": {"city": "Rome"}},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
    ], "tools": [TOOL]})
    assert got.chat.messages == [
        ChatMessage("system", "Be brief."), ChatMessage("user", "Weather?\nNow"),
        ChatMessage("assistant", "Checking.", [ToolCall("c1", "get_weather", '{"city": "Oslo"}'),
                                               ToolCall("c2", "get_weather", '{"city": "Rome"}')]),
        ChatMessage("tool", "3 C", tool_call_id="c1"), ChatMessage("tool", "20 C", tool_call_id="c2")]
    assert got.messages[0] == {"role": "user", "content": "Weather?\nNow"}  # stored without the instructions
    assert got.chat.chat.tools[0]["function"]["name"] == "get_weather" and got.chat.tool_mode.choice == "auto"
    assert got.echo["tool_choice"] == "auto" and got.echo["tools"] == [TOOL] and got.store and not got.stream


def test_sampling_limits_and_output_constraints_are_the_chat_paths():
    got = parse({"input": "hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True,
                 "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                     "strict": True}}})
    p = got.chat.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, got.stream) == (7, 0.5, 0.9, 3, True)
    assert p.structured.kind == "json_schema" and json.loads(p.structured.spec) == {"type": "object"}
    assert parse({"input": "hi", "text": {"format": {"type": "json_object"}}}).chat.params.structured.kind == "json"
    named = parse({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named.chat.tool_mode.named == "get_weather" and named.chat.params.structured.kind == "json_schema"
    assert parse({"input": "hi", "reasoning": {"effort": None}, "truncation": "disabled", "user": "u",
                  "metadata": {"k": "v"}, "store": False}).store is False
    accepted = {"effort": None, "summary": "detailed", "generate_summary": "auto", "context": "current_turn",
                "mode": "standard"}
    assert parse({"input": "hi", "reasoning": accepted}).echo["store"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "hi", "reasoning": {"effort": "none", "summary": "auto"}}, "reasoning.effort"),
    ({"input": "hi", "reasoning": {"summary": "everything"}}, "reasoning.summary"),
    ({"input": "hi", "reasoning": {"context": "all_turns"}}, "reasoning.context"),
    ({"input": "hi", "reasoning": {"budget": 5}}, "reasoning.budget"),
    ({"input": "hi", "reasoning": "high"}, "reasoning"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "hi", "max_tokens": 5}, "max_tokens"),  # the chat name: not read here, so not ignored either
    ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "hi", "n": 2}, "n"),
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
                              "verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),  # no tools
    ({"input": "hi", "temperature": 500}, "temperature"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_bad_or_unbuilt_fields_are_a_400_naming_the_responses_field(body, param):
    err = refused(body)
    assert err.param == param and err.status == (404 if param == "model" else 400)


def test_previous_response_id_prepends_the_stored_conversation():
    store = ResponseStore()
    store.put("resp_1", {"id": "resp_1"}, [{"role": "user", "content": "My name is Ada."},
                                            {"role": "assistant", "content": "Hi Ada."}])
    got = parse({"input": "Name?", "instructions": "Answer.", "previous_response_id": "resp_1"}, store)
    assert [m.content for m in got.chat.messages] == ["Answer.", "My name is Ada.", "Hi Ada.", "Name?"]
    assert [m["content"] for m in got.messages] == ["My name is Ada.", "Hi Ada.", "Name?"]
    err = refused({"input": "x", "previous_response_id": "resp_gone"}, store)
    assert err.status == 404 and err.param == "previous_response_id"


# --- the store ------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_store_is_bounded_by_entries_and_bytes_and_expires():
    clock = Clock()
    store = ResponseStore(max_entries=2, max_bytes=200, ttl_s=10, clock=clock)
    for i in range(3):
        assert store.put(f"r{i}", {"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r2").body == {"id": "r2"} and len(store) == 2
    assert not store.put("big", {"text": "x" * 300}, []) and store.get("big") is None and len(store) == 2
    store.put("mid", {"text": "x" * 180}, [])  # 195 bytes: needs the room of both others
    assert len(store) == 1 and store.num_bytes <= 200
    clock.now = 10.0
    assert store.get("mid") is None and store.num_bytes == 0
    assert store.delete("mid") is False


@given(st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "wait"]), st.integers(0, 5),
                          st.integers(0, 80)), max_size=60))
def test_store_invariants_hold_under_any_operations(ops):
    clock = Clock()
    store = ResponseStore(max_entries=3, max_bytes=150, ttl_s=5, clock=clock)
    for op, key, size in ops:
        if op == "put":
            store.put(f"r{key}", {"t": "x" * size}, [{"role": "user", "content": "y"}])
        elif op == "get":
            entry = store.get(f"r{key}")
            assert entry is None or entry.expires > clock.now
        elif op == "delete":
            store.delete(f"r{key}")
        else:
            clock.now += size / 20
        store.check_invariants()


# --- the routes, over real sockets ------------------------------------------------------------


def serve(tmp_path, contexts, tok, go):
    async def main():
        client, reader, (tokenizer,), sched, _ = await started(tmp_path, contexts, tok)
        gateway = Gateway(client, StageTracker(), Metrics(), "m", MODELS, 10.0)
        app = gateway.make_app()
        app[GATEWAY] = gateway
        async with TestClient(TestServer(app)) as http:
            await go(http, tokenizer, sched, tok)
        await stopped(reader)

    asyncio.run(main())


async def answer(tokenizer, sched, tok, text: str, finish: str = "stop"):
    got = await tokenizer.answer()
    forwarded = await sched.take()
    ids = tok.encode(text) + ([] if finish == "length" else [EOS])  # the last token ends it
    sched.send(*(TokenDelta(forwarded.request_id, [i], 3) for i in ids[:-1]),
               TokenDelta(forwarded.request_id, [ids[-1]], 3, finish))
    return got


def events_of(raw: str) -> list[dict]:
    out = []
    for block in raw.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == kind.removeprefix("event: ")
        out.append(event)
    return out


def test_whole_answers_are_stored_continued_retrieved_and_deleted(tmp_path, contexts, smollm2_tokenizer):
    async def go(http, tokenizer, sched, tok):
        post = asyncio.create_task(http.post("/v1/responses", json={"model": "m", "input": "My name is Ada."}))
        await answer(tokenizer, sched, tok, " Hello Ada")
        body = await (await post).json()
        assert body["status"] == "completed" and body["incomplete_details"] is None
        assert body["output"][0]["content"][0]["text"] == " Hello Ada" and body["usage"]["input_tokens"] == 3
        got = await (await http.get(f"/v1/responses/{body['id']}")).json()
        assert got == body
        post = asyncio.create_task(http.post("/v1/responses", json={
            "input": "Name?", "previous_response_id": body["id"], "store": False}))
        sent = await answer(tokenizer, sched, tok, " Ada")
        assert [m.content for m in sent.messages] == ["My name is Ada.", " Hello Ada", "Name?"]
        second = await (await post).json()
        assert (await http.get(f"/v1/responses/{second['id']}")).status == 404  # store false
        gone = await http.delete(f"/v1/responses/{body['id']}")
        assert (await gone.json()) == {"id": body["id"], "object": "response", "deleted": True}
        missing = await http.get(f"/v1/responses/{body['id']}")
        assert missing.status == 404 and (await missing.json())["error"]["type"] == "invalid_request_error"
        bad = await http.post("/v1/responses", json={"input": "x", "previous_response_id": body["id"]})
        assert bad.status == 404 and (await bad.json())["error"]["param"] == "previous_response_id"

    serve(tmp_path, contexts, smollm2_tokenizer, go)


def test_a_stream_sends_typed_numbered_events_and_calls_found_in_the_text(tmp_path, contexts, smollm2_tokenizer):
    async def go(http, tokenizer, sched, tok):
        post = asyncio.create_task(http.post("/v1/responses", json={"input": "Hi", "stream": True}))
        await answer(tokenizer, sched, tok, " one two three", "length")
        events = events_of(await (await post).text())
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(deltas) == " one two three" and len(deltas) > 1  # streamed as it came
        final = events[-1]
        assert final["type"] == "response.incomplete" and final["response"]["output"][0]["status"] == "incomplete"
        assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        stored = await (await http.get(f"/v1/responses/{final['response']['id']}")).json()
        assert stored == final["response"]

        # tool_choice auto: the text is parsed for calls at the end, and each call streamed whole
        post = asyncio.create_task(http.post("/v1/responses", json={"input": "Weather?", "tools": [TOOL],
                                                                    "stream": True}))
        await answer(tokenizer, sched, tok, 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                            '</tool_call>')
        events = events_of(await (await post).text())
        kinds = [e["type"] for e in events]
        assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
        message, call = events[-1]["response"]["output"]
        assert message["content"][0]["text"] == "Sure."
        assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Oslo"}
        (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert done["item_id"] == call["id"] and done["output_index"] == 1 and done["arguments"] == call["arguments"]

    serve(tmp_path, contexts, smollm2_tokenizer, go)


def test_openapi_describes_the_routes_and_only_fields_that_are_read():
    from services.gateway.openai.openapi import openapi_spec
    from services.gateway.responses_api.fields import PASSED, READ

    spec = openapi_spec(["m"], secured=False)
    post = spec["paths"]["/v1/responses"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) - {"user"} <= READ | PASSED and {"input", "text", "tools"} <= set(body["properties"])
    assert "404" in spec["paths"]["/v1/responses/{response_id}"]["get"]["responses"]
    assert set(spec["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "Response" in spec["components"]["schemas"]


def test_an_error_of_the_chat_path_names_the_responses_field():
    deep = {"type": "object"}
    for _ in range(DEFAULT_LIMITS.max_schema_depth + 2):
        deep = {"type": "object", "properties": {"a": deep}}
    err = refused({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": deep}}})
    assert err.param == "text.format" and "'text.format'" in err.message and "response_format" not in err.message


def test_an_engine_error_is_an_http_error_before_output_and_an_error_event_after(tmp_path, contexts,
                                                                                 smollm2_tokenizer):
    async def go(http, tokenizer, sched, tok):
        post = asyncio.create_task(http.post("/v1/responses", json={"input": "Hi"}))
        await tokenizer.answer()
        forwarded = await sched.take()
        sched.sock.send(sched.peer, RequestError(forwarded.request_id, 400, "no token left", param="text"))
        resp = await post
        assert resp.status == 400 and (await resp.json())["error"]["message"] == "no token left"
        assert len(gateway_store(http)) == 0

        post = asyncio.create_task(http.post("/v1/responses", json={"input": "Hi", "stream": True}))
        await tokenizer.answer()
        forwarded = await sched.take()
        sched.send(TokenDelta(forwarded.request_id, tok.encode(" Hello"), 3))
        await asyncio.sleep(0.1)
        sched.sock.send(sched.peer, RequestError(forwarded.request_id, 500, "the engine failed", "internal_error"))
        events = events_of(await (await post).text())
        assert events[-1]["type"] == "error" and events[-1]["message"] == "the engine failed"
        assert events[-1]["sequence_number"] == len(events) - 1
        assert "response.output_text.delta" in [e["type"] for e in events]
        assert len(gateway_store(http)) == 0  # nothing kept of a failed response

    serve(tmp_path, contexts, smollm2_tokenizer, go)


def gateway_store(http) -> ResponseStore:
    return http.server.app[GATEWAY].responses.store
