"""JSON numbers bounded in the grammar (shared.json_grammar): xgrammar's matcher run on strings."""

from __future__ import annotations

import json

import pytest

from services.gateway.limits import DEFAULT_LIMITS
from services.gateway.openai.errors import ApiError
from services.gateway.openai.structured import output_constraint
from shared.json_grammar import bound_schema, bounded_json_grammar

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402


def _accepts(schema: dict, bounded: bool = True):
    text = json.dumps(schema)
    grammar = xgr.Grammar.from_ebnf(bounded_json_grammar(text)) if bounded else \
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    return lambda answer: _is_grammar_accept_string(grammar, answer)


def _one(prop: dict) -> dict:
    return {"type": "object", "properties": {"x": prop}, "required": ["x"]}


@pytest.mark.parametrize("value", ["12345678901234567", "1.2345678901234567", "-9.8765432109876543e-308",
                                   "0.30000000000000004", "0.0000000000000001", "1E+308", "0", "-0", "0.0"])
def test_a_number_of_17_significant_digits_and_a_3_digit_exponent_is_accepted(value):
    assert _accepts(_one({"type": "number"}))(f'{{"x": {value}}}')


@pytest.mark.parametrize("value", ["123456789012345678", "1.23456789012345678", "12345678901234567.8",
                                   "0.300000000000000004", "1e1000", "01"])
def test_a_number_past_a_float64_is_refused(value):
    accepts = _accepts(_one({"type": "number"}))
    assert not accepts(f'{{"x": {value}}}')
    if value != "01":  # xgrammar's own grammar takes any length: this is what the bound changes
        assert _accepts(_one({"type": "number"}), bounded=False)(f'{{"x": {value}}}')


def test_an_integer_without_bounds_has_int64s_19_digits():
    accepts = _accepts(_one({"type": "integer"}))
    assert accepts('{"x": 1234567890123456789}') and accepts('{"x": -1234567890123456789}')
    assert not accepts('{"x": 12345678901234567890}') and not accepts('{"x": 1.5}')


def test_an_integer_is_held_to_its_schemas_bounds():
    accepts = _accepts(_one({"type": "integer", "minimum": 0, "maximum": 120}))
    assert accepts('{"x": 120}') and accepts('{"x": 7}')
    assert not accepts('{"x": 121}') and not accepts('{"x": 1200}') and not accepts('{"x": -1}')
    one_sided = _accepts(_one({"type": "integer", "minimum": 0}))  # the other side: int64's
    assert one_sided('{"x": 9223372036854775807}')
    assert not one_sided('{"x": 9223372036854775808}') and not one_sided('{"x": -1}')
    assert not _accepts(_one({"type": "integer", "minimum": 0}), bounded=False)('{"x": -1}')


def test_a_one_sided_number_range_gets_its_other_side():
    accepts = _accepts(_one({"type": "number", "minimum": 0}))
    assert accepts('{"x": 99999999999999999}') and accepts('{"x": 2.5}')
    assert not accepts('{"x": 999999999999999999}') and not accepts('{"x": -1}')


def test_numbers_inside_free_json_and_arrays_are_bounded_too():
    accepts = _accepts({"type": "object"})
    assert accepts('{"a": [1, 2.5, {"b": 1111111111}]}')
    assert not accepts('{"a": [1, 2.5, {"b": 111111111111111111111}]}')
    arrays = _accepts(_one({"type": "array", "items": {"type": "number"}}))
    assert arrays('{"x": [1, 2]}') and not arrays('{"x": [1, 111111111111111111111]}')


def test_enum_and_const_values_are_left_as_they_are():
    value = {"type": "integer", "minimum": 1}
    schema = _one({"enum": [value], "default": value})
    assert bound_schema(schema) == schema
    assert bound_schema(_one(value))["properties"]["x"]["maximum"] == 2**63 - 1


def test_the_request_can_opt_out():
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": _one({"type": "number"})}}
    bounded = output_constraint({"response_format": schema}, DEFAULT_LIMITS)
    assert not bounded.unbounded_numbers
    free = output_constraint({"response_format": schema, "structured_outputs": {"unbounded_numbers": True}},
                             DEFAULT_LIMITS)
    assert free.unbounded_numbers and free.spec == bounded.spec
    with pytest.raises(ApiError) as err:
        output_constraint({"structured_outputs": {"json_object": True, "unbounded_numbers": "yes"}}, DEFAULT_LIMITS)
    assert err.value.param == "structured_outputs"
