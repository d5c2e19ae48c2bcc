"""The request fields are declared once (services/gateway/openai/fields.py), and the parsers, the
field policy and /openapi.json agree with that declaration."""

from __future__ import annotations

import pytest

from services.gateway.limits import RequestLimits
from services.gateway.openai import field_policy
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.errors import ApiError
from services.gateway.openai.fields import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    FIELDS,
    GENERATION,
    INT64_MAX,
    TOKENIZE,
    Limit,
    fields_of,
)
from services.gateway.openai.openapi import openapi_spec

NAMES = ["m"]
LIMITS = RequestLimits(max_n=3, max_logprobs=7, max_tools=5, max_stop=2, max_stop_chars=9, max_prompts=4)
PATHS = {COMPLETION: "/v1/completions", CHAT: "/v1/chat/completions", TOKENIZE: "/tokenize",
         DETOKENIZE: "/detokenize"}
BODIES = {COMPLETION: {"model": "m", "prompt": "Hi"}, CHAT: {"model": "m", "messages": [{"role": "user",
                                                                                        "content": "Hi"}]}}
PARSERS = {COMPLETION: parse_completion, CHAT: parse_chat}
# fields read only together with another: beam_width with beam search, min_tokens up to max_tokens,
# top_logprobs with logprobs
CONTEXT = {"beam_width": {"use_beam_search": True}, "min_tokens": {"max_tokens": INT64_MAX},
           "top_logprobs": {"logprobs": True}}


def _body_schema(spec: dict, endpoint: str) -> dict:
    return spec["paths"][PATHS[endpoint]]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_no_field_is_declared_twice():
    pairs = [(f.name, e) for f in FIELDS for e in f.on]
    assert len(pairs) == len(set(pairs)), sorted(p for p in pairs if pairs.count(p) > 1)
    declared = {f.name for f in FIELDS if f.on & GENERATION}
    assert not declared & field_policy.HARMLESS and not declared & field_policy.UNSUPPORTED.keys()


@pytest.mark.parametrize("endpoint", list(PATHS))
def test_openapi_states_every_declared_field_with_its_bounds(endpoint):
    """Each body in /openapi.json has exactly the declared fields, with the limits the gateway runs with."""
    schema = _body_schema(openapi_spec(NAMES, secured=False, lim=LIMITS), endpoint)
    props = schema["properties"]
    assert set(props) == {f.name for f in fields_of(endpoint)}
    for f in fields_of(endpoint):
        assert props[f.name] == f.resolved(LIMITS, NAMES), f.name
        assert (f.name in schema.get("required", ())) == (endpoint in f.required_on), f.name
    if "n" in props:
        assert props["n"]["maximum"] == LIMITS.max_n and props["prompt_logprobs"]["maximum"] == LIMITS.max_logprobs


def test_limits_in_the_declarations_are_gateway_flags():
    def limits_in(value):
        if isinstance(value, Limit):
            yield value.name
        elif isinstance(value, dict):
            for v in value.values():
                yield from limits_in(v)
        elif isinstance(value, list):
            for v in value:
                yield from limits_in(v)

    names = {n for f in FIELDS for n in limits_in(f.schema)}
    assert names - {"model_names"} <= set(RequestLimits.__dataclass_fields__) and "max_n" in names


def _numeric(endpoint: str):
    for f in fields_of(endpoint):
        if f.schema.get("type") in ("integer", "number"):
            yield f.name, f.resolved(LIMITS)


def _parse(endpoint: str, name: str, value):
    return PARSERS[endpoint]({**BODIES[endpoint], **CONTEXT.get(name, {}), name: value}, set(NAMES), LIMITS)


@pytest.mark.parametrize("endpoint", sorted(GENERATION))
def test_the_parsers_refuse_what_is_past_a_declared_bound(endpoint):
    checked = 0
    for name, schema in _numeric(endpoint):
        step = 1 if schema["type"] == "integer" else 0.5
        low = schema["minimum"] if schema.get("exclusiveMinimum") else schema["minimum"] - step
        for value in (schema["maximum"] + step, low):
            with pytest.raises(ApiError) as info:
                _parse(endpoint, name, value)
            assert info.value.status == 400 and info.value.param == name, (name, value, info.value.message)
            checked += 1
    assert checked >= 30


@pytest.mark.parametrize("endpoint", sorted(GENERATION))
def test_the_parsers_accept_the_declared_bounds(endpoint):
    for name, schema in _numeric(endpoint):
        edges = [schema["maximum"]] + ([] if schema.get("exclusiveMinimum") else [schema["minimum"]])
        if name == "max_tokens":  # its minimum, 0, is for echo: the prompt alone, scored
            edges = [schema["maximum"]]
            if endpoint == COMPLETION:
                PARSERS[endpoint]({**BODIES[endpoint], "max_tokens": 0, "echo": True}, set(NAMES), LIMITS)
        for value in edges:
            _parse(endpoint, name, value)


def _sized(schema: dict):
    """The size bounds of a field's schema, its own or those of its oneOf shapes: (key, bound)."""
    for shape in [schema, *schema.get("oneOf", ())]:
        for key in ("maxItems", "maxProperties", "maxLength"):
            if key in shape:
                yield key, shape[key]


# one valid element of each size-bounded field, to build a value one past its bound
ELEMENT = {
    "prompt": lambda i: "a", "stop": lambda i: "a", "bad_words": lambda i: "a", "cache_salt": lambda i: "x",
    "stop_token_ids": lambda i: i, "allowed_token_ids": lambda i: i, "logit_bias": lambda i: (str(i), 1.0),
    "tools": lambda i: {"type": "function", "function": {"name": f"f{i}"}},
}


@pytest.mark.parametrize("endpoint", sorted(GENERATION))
def test_the_parsers_refuse_what_is_past_a_declared_size(endpoint):
    """Every size bound a field declares (maxItems, maxProperties, maxLength) is one the parser holds:
    one past it is a 400 naming the field, at it is accepted."""
    for f in fields_of(endpoint):
        for key, bound in _sized(f.resolved(LIMITS)):
            assert f.name in ELEMENT, f"add an element of {f.name} to ELEMENT"
            items = [ELEMENT[f.name](i) for i in range(bound + 1)]
            value = dict(items) if key == "maxProperties" else "".join(items) if key == "maxLength" else items
            with pytest.raises(ApiError) as info:
                _parse(endpoint, f.name, value)
            assert info.value.status == 400 and info.value.param == f.name, (f.name, key, info.value.message)
            _parse(endpoint, f.name, value[:-1] if key != "maxProperties" else dict(items[:-1]))


@pytest.mark.parametrize(("endpoint", "name", "value"), [
    (COMPLETION, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (COMPLETION, "tool_choice", "required"),
    (CHAT, "echo", True),
])
def test_a_field_of_the_other_endpoint_is_refused_where_declared_so(endpoint, name, value):
    with pytest.raises(ApiError) as info:
        PARSERS[endpoint]({**BODIES[endpoint], name: value}, set(NAMES), LIMITS)
    assert info.value.param == name and "not supported" in info.value.message
    PARSERS[endpoint]({**BODIES[endpoint], name: None}, set(NAMES), LIMITS)  # "not used": accepted


def test_parallel_tool_calls_is_ignored_on_completions(caplog):
    parsed = parse_completion({**BODIES[COMPLETION], "parallel_tool_calls": True}, set(NAMES), LIMITS)
    assert parsed.params.n == 1 and "parallel_tool_calls" not in caplog.text
