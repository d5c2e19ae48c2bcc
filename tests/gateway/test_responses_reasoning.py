"""Reasoning output in the Responses API: with `--reasoning-parser deepseek_r1` the engine (a
stand-in over real ZeroMQ sockets) emits `<think>...</think>` tokens one at a time, the gateway
serves HTTP on a real port, and the openai SDK (`responses.create`, `responses.stream`) reads the
thinking as a `reasoning` item before the message, whole and streamed, with its reasoning tokens
counted; tool calls are parsed from the content alone, a grammar-constrained answer is all
content, the stored conversation leaves the reasoning out; without a parser there is no
reasoning item; `reasoning.effort` is refused, `reasoning.summary` accepted."""

from __future__ import annotations

import asyncio

import openai
import pytest
from aiohttp.test_utils import TestServer

from services.gateway.app import Gateway
from services.gateway.health import StageTracker
from services.gateway.metrics import Metrics
from shared.messages import TokenDelta
from tests.gateway.engine_stand_ins import started, stopped

THINKING = "The user wants a capital."
ANSWER = f"<think>{THINKING}</think>\n\nParis."
CONTENT = "\n\nParis."
QUESTION = "The capital of France?"


def run(tmp_path, contexts, tok, answers: list[tuple[str, str]], call, parser: str | None = "deepseek_r1"):
    """call(sdk) against a gateway whose engine answers the requests, in order, with answers'
    (text, finish_reason) one token per delta; returns (call's result, each request's messages)."""
    prompts: list[list[str]] = []

    async def go():
        engine, reader, (t,), sched, _ = await started(tmp_path, contexts, tok)
        gateway = Gateway(engine, StageTracker(), Metrics(), "m", {"m"}, 10.0, reasoning_parser=parser)
        server = TestServer(gateway.make_app())
        await server.start_server()

        async def play():
            for text, finish in answers:
                ids = tok.encode(text, add_special_tokens=False)
                got = await t.answer()
                prompts.append([m.content for m in got.messages])
                await sched.take()
                for i, tid in enumerate(ids):
                    sched.send(TokenDelta(got.request_id, [tid], 3, finish if i == len(ids) - 1 else None))
                    await asyncio.sleep(0)

        player = asyncio.get_running_loop().create_task(play())
        sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
        try:
            return await call(sdk)
        finally:
            await sdk.close()
            player.cancel()
            await server.close()
            await stopped(reader)

    return asyncio.run(go()), prompts


def thinking_tokens(tok, text: str) -> int:
    """How many of text's tokens it takes to reach the end of `</think>`."""
    ids = tok.encode(text, add_special_tokens=False)
    return next(i for i in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:i]))


def test_whole_response_has_a_reasoning_item_before_the_message(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        first = await sdk.responses.create(model="m", input=QUESTION, reasoning={"summary": "auto"})
        stored = await sdk.responses.retrieve(first.id)
        second = await sdk.responses.create(model="m", input="And Germany?", previous_response_id=first.id)
        # the SDK's way of carrying a conversation by hand: the output items put back as input
        third = await sdk.responses.create(model="m", input=[
            {"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "Spain?"}])
        return first, stored, second, third

    (first, stored, second, third), prompts = run(tmp_path, contexts, smollm2_tokenizer, [(ANSWER, "stop")] * 3, call)
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", THINKING)] and reasoning.summary == []
    assert message.type == "message" and first.output_text == CONTENT
    assert first.usage.output_tokens == len(smollm2_tokenizer.encode(ANSWER, add_special_tokens=False))
    assert first.usage.output_tokens_details.reasoning_tokens == thinking_tokens(smollm2_tokenizer, ANSWER) == 12
    assert stored.output[0].content[0].text == THINKING and stored.output_text == CONTENT  # the store keeps it
    assert second.output[0].type == "reasoning"
    # neither previous_response_id nor reasoning items given back feed the thinking into the prompt
    assert prompts[1] == [QUESTION, CONTENT, "And Germany?"]
    assert prompts[2] == [QUESTION, CONTENT, "Spain?"]


def test_streamed_response_streams_the_reasoning_item_then_the_message(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        async with sdk.responses.stream(model="m", input=QUESTION) as stream:
            events = [e async for e in stream]
            return events, await stream.get_final_response()

    (events, final), _ = run(tmp_path, contexts, smollm2_tokenizer, [(ANSWER, "stop")], call)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_delta, last_delta = kinds.index("response.reasoning_text.delta"), max(
        i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta")
    assert kinds[:first_delta] == ["response.created", "response.in_progress", "response.output_item.added",
                                   "response.content_part.added"]
    assert kinds[last_delta + 1:] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * (len(kinds) - last_delta - 10),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    added = events[2]
    assert added.item.type == "reasoning" and added.output_index == 0 and events[3].part.type == "reasoning_text"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == THINKING and len(deltas) > 1  # streamed as it came
    assert all(e.item_id == added.item.id and e.output_index == 0 for e in events[3:last_delta + 3])
    assert events[last_delta + 1].text == THINKING and events[last_delta + 3].item.content[0].text == THINKING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CONTENT
    assert events[last_delta + 4].output_index == 1 and events[last_delta + 4].item.type == "message"
    assert not any("think" in getattr(e, "delta", "") for e in events)
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == CONTENT
    assert final.output[0].content[0].text == THINKING and final.output[0].id == added.item.id
    assert final.usage.output_tokens_details.reasoning_tokens == 12


def test_an_answer_cut_off_while_thinking_is_an_incomplete_reasoning_item(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        whole = await sdk.responses.create(model="m", input=QUESTION)
        async with sdk.responses.stream(model="m", input=QUESTION) as stream:
            events = [e async for e in stream]  # (the SDK's final response is a completed one only)
            return whole, [e.type for e in events], events[-1].response

    (whole, kinds, streamed), _ = run(tmp_path, contexts, smollm2_tokenizer, [("<think>Hmm, let me", "length")] * 2,
                                      call)
    for got in (whole, streamed):
        assert got.status == "incomplete" and [i.type for i in got.output] == ["reasoning"]
        assert got.output[0].status == "incomplete" and got.output[0].content[0].text == "Hmm, let me"
        assert got.usage.output_tokens_details.reasoning_tokens == got.usage.output_tokens
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.incomplete"


def test_without_a_parser_there_is_no_reasoning_item(tmp_path, contexts, smollm2_tokenizer):
    async def call(sdk):
        whole = await sdk.responses.create(model="m", input=QUESTION)
        async with sdk.responses.stream(model="m", input=QUESTION) as stream:
            kinds = [e.type async for e in stream]
            return whole, kinds, await stream.get_final_response()

    (whole, kinds, streamed), _ = run(tmp_path, contexts, smollm2_tokenizer, [(ANSWER, "stop")] * 2, call, parser=None)
    for got in (whole, streamed):
        assert [i.type for i in got.output] == ["message"] and got.output_text == ANSWER
        assert got.usage.output_tokens_details.reasoning_tokens == 0
    assert not any("reasoning" in k for k in kinds)


def test_tool_calls_are_parsed_from_the_content_only(tmp_path, contexts, smollm2_tokenizer):
    answer = ('<think>I should call {"name": "decoy", "arguments": {}} maybe.</think>'
              '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}},
             {"type": "function", "name": "decoy", "parameters": {"type": "object"}}]

    async def call(sdk):
        whole = await sdk.responses.create(model="m", input=QUESTION, tools=tools)
        async with sdk.responses.stream(model="m", input=QUESTION, tools=tools) as stream:
            events = [e async for e in stream]
            return whole, events, await stream.get_final_response()

    (whole, events, streamed), _ = run(tmp_path, contexts, smollm2_tokenizer, [(answer, "stop")] * 2, call)
    for got in (whole, streamed):
        assert [i.type for i in got.output] == ["reasoning", "function_call"]
        assert got.output[0].content[0].text.startswith("I should call") and got.output[1].name == "weather"
    # the thinking streams live even though the calls are found only at the end
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") > 1
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.function_call_arguments.done")


def test_a_constrained_answer_is_all_content(tmp_path, contexts, smollm2_tokenizer):
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}}

    async def call(sdk):
        return await sdk.responses.create(model="m", input=QUESTION, text={"format": fmt})

    got, _ = run(tmp_path, contexts, smollm2_tokenizer, [('{"name": "Paris"}', "stop")], call)
    assert [i.type for i in got.output] == ["message"] and got.output_text == '{"name": "Paris"}'
    assert got.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("reasoning", [{"effort": "high"}, {"effort": "none", "summary": "auto"}])
def test_reasoning_effort_is_refused_not_ignored(tmp_path, contexts, smollm2_tokenizer, reasoning):
    async def call(sdk):
        with pytest.raises(openai.BadRequestError) as err:
            await sdk.responses.create(model="m", input=QUESTION, reasoning=reasoning)
        return err.value.body

    body, prompts = run(tmp_path, contexts, smollm2_tokenizer, [], call)
    assert body["param"] == "reasoning.effort" and prompts == []
