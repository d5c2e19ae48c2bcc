"""`--reasoning-parser deepseek_r1` at the gateway: the engine (a stand-in over real ZeroMQ sockets)
emits `<think>...</think>` tokens one at a time, the gateway serves HTTP on a real port, and the
openai SDK reads the thinking as `reasoning_content`, whole and streamed; `include_reasoning`
false drops it; tool calls are parsed from the content alone."""

from __future__ import annotations

import openai

from tests.gateway.engine_stand_ins import answering_gateway

ANSWER = "<think>The user wants a capital.</think>\n\nParis."


def run(tmp_path, contexts, tok, answer: str, call):
    """call(client) against a gateway whose engine answers each request with answer's tokens."""
    return answering_gateway(tmp_path, contexts, tok, answer,
                             lambda url: openai.AsyncOpenAI(base_url=url("/v1"), api_key="k", max_retries=0), call)


MESSAGES = [{"role": "user", "content": "The capital of France?"}]


def test_whole_answer_has_reasoning_content_and_content(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        return await sdk.chat.completions.create(model="m", messages=MESSAGES)

    msg = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call).choices[0].message
    assert msg.content == "\n\nParis."
    assert msg.model_extra["reasoning_content"] == "The user wants a capital."


def test_streamed_answer_splits_the_same_and_no_marker_leaks(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        return [c.choices[0] async for c in stream]

    choices = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call)
    reasoning = [c.delta.model_extra.get("reasoning_content") for c in choices]
    content = "".join(c.delta.content or "" for c in choices)
    assert "".join(r or "" for r in reasoning) == "The user wants a capital."
    assert sum(r is not None for r in reasoning) > 1  # it streamed, not all at the end
    assert content == "\n\nParis." and choices[-1].finish_reason == "stop"
    assert not any("think" in (r or "") or "think" in (c.delta.content or "")
                   for r, c in zip(reasoning, choices, strict=True))


def test_include_reasoning_false_drops_the_thinking(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        whole = await sdk.chat.completions.create(model="m", messages=MESSAGES, extra_body={"include_reasoning": False})
        stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                                   extra_body={"include_reasoning": False})
        return whole, [c.choices[0] async for c in stream]

    whole, chunks = run(tmp_path, contexts, smollm2_tokenizer, ANSWER, call)
    assert whole.choices[0].message.content == "\n\nParis."
    assert "reasoning_content" not in whole.choices[0].message.model_extra
    assert "".join(c.delta.content or "" for c in chunks) == "\n\nParis."
    assert not any("reasoning_content" in c.delta.model_extra for c in chunks)


def test_tool_calls_are_parsed_from_the_content_only(tmp_path, contexts, smollm2_tokenizer):
    answer = ('<think>I should call {"name": "decoy", "arguments": {}} maybe.</think>'
              '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "decoy", "parameters": {"type": "object"}}}]

    async def call(sdk):
        whole = await sdk.chat.completions.create(model="m", messages=MESSAGES, tools=tools)
        stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, tools=tools, stream=True)
        return whole, [c.choices[0] async for c in stream]

    whole, chunks = run(tmp_path, contexts, smollm2_tokenizer, answer, call)
    msg = whole.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["weather"]
    assert msg.model_extra["reasoning_content"].startswith("I should call")
    streamed = [tc.function.name for c in chunks for tc in (c.delta.tool_calls or [])]
    assert streamed == ["weather"] and chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
        msg.model_extra["reasoning_content"]
