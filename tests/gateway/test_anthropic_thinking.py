"""Thinking on /v1/messages with `--reasoning-parser deepseek_r1`: the engine (a stand-in over real
ZeroMQ sockets) emits `<think>...</think>` tokens one at a time, the gateway serves HTTP on a real
port, and the anthropic SDK reads the thinking as a first `thinking` block, whole and streamed
(`messages.stream` events); thinking disabled or absent drops it; tool calls are parsed from the
content alone; without a parser, thinking enabled is a 400 naming the flag; Anthropic's budget
rules hold."""

from __future__ import annotations

import anthropic
import pytest

from services.gateway.anthropic.translate import parse_messages_request
from services.gateway.openai.errors import ApiError
from tests.gateway.engine_stand_ins import answering_gateway

ANSWER = "<think>The user wants a capital.</think>\n\nParis."
ASK = [{"role": "user", "content": "The capital of France?"}]
THINK = {"type": "enabled", "budget_tokens": 1024}


def run(tmp_path, contexts, tok, answer: str, call, reasoning_parser: str | None = "deepseek_r1"):
    """call(client) against a gateway whose engine answers each request with answer's tokens."""
    return answering_gateway(tmp_path, contexts, tok, answer,
                             lambda url: anthropic.AsyncAnthropic(base_url=url(""), api_key="k", max_retries=0), call,
                             reasoning_parser)


def test_a_whole_message_has_a_thinking_block_before_its_text(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        return await sdk.messages.create(model="m", max_tokens=2048, messages=ASK, thinking=THINK)

    msg = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user wants a capital." and msg.content[0].signature == ""
    assert msg.content[1].text == "\n\nParis." and msg.stop_reason == "end_turn"


def test_a_streamed_message_streams_the_thinking_block_first(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        async with sdk.messages.stream(model="m", max_tokens=2048, messages=ASK, thinking=THINK) as stream:
            events = [e async for e in stream]
            return events, await stream.get_final_message()

    events, final = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call)
    raw = [e for e in events if e.type.startswith("content_block_")]
    starts = [(e.index, e.content_block.type) for e in raw if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    order = [(e.type, e.index) for e in raw if e.type != "content_block_delta"]
    assert order == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                     ("content_block_stop", 1)]
    thinking = [e.delta.thinking for e in raw if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(thinking) == "The user wants a capital." and len(thinking) > 1  # streamed as it came
    assert not any("think" in t for t in thinking)  # no part of a marker leaks
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user wants a capital." and final.content[1].text == "\n\nParis."


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
def test_thinking_not_enabled_is_split_off_and_dropped(tmp_path, contexts, smollm2_tokenizer, thinking):
    extra = {} if thinking is None else {"thinking": thinking}

    async def call(sdk):
        whole = await sdk.messages.create(model="m", max_tokens=64, messages=ASK, **extra)
        async with sdk.messages.stream(model="m", max_tokens=64, messages=ASK, **extra) as stream:
            events = [e async for e in stream]
        return whole, events

    whole, events = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call)
    assert [(b.type, b.text) for b in whole.content] == [("text", "\n\nParis.")]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "\n\nParis."


def test_tool_calls_are_parsed_from_the_content_only(tmp_path, contexts, smollm2_tokenizer):
    answer = ('<think>I could call {"name": "decoy", "arguments": {}} maybe.</think>'
              '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    tools = [{"name": "weather", "input_schema": {"type": "object"}},
             {"name": "decoy", "input_schema": {"type": "object"}}]

    async def call(sdk):
        whole = await sdk.messages.create(model="m", max_tokens=2048, messages=ASK, tools=tools, thinking=THINK)
        async with sdk.messages.stream(model="m", max_tokens=2048, messages=ASK, tools=tools,
                                       thinking=THINK) as stream:
            events = [e async for e in stream]
            return whole, events, await stream.get_final_message()

    whole, events, final = run(tmp_path, contexts, smollm2_tokenizer, answer, call)
    for msg in (whole, final):
        assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
        assert msg.content[0].thinking.startswith("I could call") and msg.content[1].name == "weather"
        assert msg.content[1].input == {"city": "Paris"}
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "tool_use")]


def test_without_a_reasoning_parser_thinking_enabled_is_a_400_naming_the_flag(tmp_path, contexts,
                                                                             smollm2_tokenizer):
    async def call(sdk):
        with pytest.raises(anthropic.BadRequestError) as info:
            await sdk.messages.create(model="m", max_tokens=2048, messages=ASK, thinking=THINK)
        plain = await sdk.messages.create(model="m", max_tokens=64, messages=ASK, thinking={"type": "disabled"})
        return info.value, plain

    err, plain = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call, reasoning_parser=None)
    assert err.status_code == 400 and err.body["error"]["type"] == "invalid_request_error"
    assert "--reasoning-parser" in err.body["error"]["message"]
    assert plain.content[0].text == ANSWER  # no parser: the answer as it came


def parse(thinking, max_tokens=2048, parser="deepseek_r1"):
    return parse_messages_request({"model": "m", "max_tokens": max_tokens, "messages": ASK, "thinking": thinking},
                                  {"m"}, reasoning_parser=parser)


@pytest.mark.parametrize("thinking, max_tokens, words", [
    ({"type": "enabled", "budget_tokens": 1023}, 2048, "at least 1024"),
    ({"type": "enabled"}, 2048, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 1024}, 1024, "greater than"),
    ({"type": "between_tools"}, 2048, "must be"),
    ({"type": "adaptive", "display": "full"}, 2048, "display"),
    ("enabled", 2048, "must be"),
])
def test_anthropics_thinking_rules_are_held(thinking, max_tokens, words):
    with pytest.raises(ApiError) as info:
        parse(thinking, max_tokens)
    assert info.value.status == 400 and info.value.param == "thinking" and words in info.value.message


def test_what_shows_the_thinking():
    assert parse(THINK).show_thinking and parse({"type": "adaptive"}).show_thinking
    assert not parse({**THINK, "display": "omitted"}).show_thinking
    assert not parse({"type": "disabled"}).show_thinking and not parse(None).show_thinking
    assert not parse({"type": "disabled"}, parser=None).show_thinking
    with pytest.raises(ApiError, match="--reasoning-parser"):
        parse(THINK, parser=None)
