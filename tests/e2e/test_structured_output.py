"""Structured output through the openai client on the tiny random Llama: whatever the
(random) model prefers, every answer parses and validates against its schema."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Give me the data as JSON."}]

# bounded strings, numbers and arrays: a random model has no reason to ever stop a digit string
_S = {"type": "string", "maxLength": 12}
_I = {"type": "integer", "minimum": -50, "maximum": 999}
SCHEMAS = [
    {"type": "object", "properties": {"name": _S}, "required": ["name"]},
    {"type": "object", "properties": {"age": _I}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": _I, "y": _I}, "required": ["x", "y"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": _I, "minItems": 1,
                                              "maxItems": 4}}, "required": ["ids"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": _S, "id": _I},
                                               "required": ["name", "id"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "n": _I},
     "required": ["status", "n"]},
    {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["level"]},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "count": _I,
                                      "note": _S}, "required": ["kind", "count"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": _I, "y": _I}, "required": ["x", "y"]}}},
     "required": ["points"]},
    {"type": "object", "properties": {"value": {"anyOf": [_I, {"type": "boolean"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 8}}, "required": ["maybe"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5}},
     "required": ["flags"]},
    {"type": "object", "properties": {"first": _S, "last": _S, "age": _I},
     "required": ["first", "last", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": _I}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]}, "hours": {"type": "array", "maxItems": 3,
                                                                                   "items": {"enum": [8, 9, 10]}}},
     "required": ["day", "hours"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"v": _I},
                                               "required": ["v"]}, "items": {"type": "array", "maxItems": 2,
                                                                             "items": {"enum": ["x", "y"]}}},
     "required": ["meta", "items"]},
]


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_output_validates_whole_and_streamed(tiny_server):
    """The 20 schemas at once (they batch in the engine), each whole and streamed."""

    async def one(c, i: int) -> tuple[object, str]:
        body = dict(model=MODEL, messages=MESSAGES, max_tokens=200, seed=i, temperature=1.0,
                    response_format=_format(SCHEMAS[i]))
        whole = await c.chat.completions.create(**body)
        text = "".join([ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(
            **body, stream=True) if ch.choices])
        return whole, text

    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(len(SCHEMAS))))

    for schema, (whole, streamed) in zip(SCHEMAS, asyncio.run(run()), strict=True):
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
        assert streamed == whole.choices[0].message.content  # seeded: the same answer


def test_json_object_on_completions_and_pydantic_parse(client, tiny_server):
    import pydantic

    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=300, temperature=0.8, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        age: int = pydantic.Field(ge=0, le=120)
        admin: bool

    parsed = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=150, response_format=Person,
                                           temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Person)

    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            return await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})

    assert (asyncio.run(run())).choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("constraint, check", [
    ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: len(t) == 6 and t[3] == "-"),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
    ({"guided_json": {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k"]}},
     lambda t: isinstance(json.loads(t)["k"], int)),
])
def test_vllm_constraints(client, constraint, check):
    for n_seed in range(2):
        out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, seed=n_seed,
                                        extra_body=constraint)
        assert check(out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_400(client, tiny_server, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param
    assert "/project" not in info.value.body["message"]


def test_the_executor_never_compiled_a_grammar(client, tiny_server):
    """Run last: every grammar above reached the executor compiled by the tokenizer stage, so
    the executor only deserialized (it logs each spec it must compile itself)."""
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                   response_format={"type": "json_object"})
    assert "compiling it here" not in tiny_server.log_path.read_text(errors="replace")
