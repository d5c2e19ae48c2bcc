"""JSON schemas as xgrammar EBNF in which no number can go on without end.

xgrammar's own JSON grammar lets a number have any count of digits: a small model that
starts repeating a digit (SmolLM2 writes `"population_millions": 1111111...`) runs until
max_tokens and the client's parse fails. A float64 holds 17 significant digits and a
3-digit exponent, an int64 19 digits, so the grammar here holds numbers to that:

- a `number` with no minimum or maximum (xgrammar's `basic_number`, which also types the
  values of `{"type": "object"}` and of untyped properties): at most 17 significant digits
  (integer and fraction digits together; after `0.`, at most 16 zeros before the first
  nonzero one) and an exponent of at most 3 digits;
- an `integer` with no bounds (`basic_integer`): at most 19 digits;
- an `integer` with one bound: the other is int64's, so xgrammar's range grammar holds it
  to the digits both allow; with both, that range grammar already does;
- a `number` with one bound: the other is +-(10**17 - 1) (xgrammar's range grammar has
  integer digits up to it and 6 fraction digits); with both, xgrammar's range grammar.

Other things can still repeat until max_tokens, and are left to the schema: strings
without `maxLength`, arrays without `maxItems`, and the free-form objects of a
`{"type": "object"}` (json_object) answer; free whitespace is off (compact separators).
`bounded_json_grammar` returns the EBNF; the tokenizer stage compiles it like any grammar.
"""

from __future__ import annotations

import json
import re

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SIGNIFICANT_DIGITS = 17
MAX_EXPONENT_DIGITS = 3
MAX_INTEGER_DIGITS = 19
NUMBER_BOUND = 10**MAX_SIGNIFICANT_DIGITS - 1  # the missing side of a one-sided number range
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")
_VALUES = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas


def _digit_rules() -> str:
    """The bounded digit runs as chains of rules, one per digit left (written as `{m,n}`
    repetitions and alternatives instead, the compiled grammar of any JSON object was 2.8 MB
    on SmolLM2; this way 0.5 MB, against xgrammar's own 92 KB)."""
    n = MAX_SIGNIFICANT_DIGITS
    rules = ['bounded_number_mantissa ::= "0" ("." bounded_zeros_{0}) | "0" | [1-9] bounded_int_{0}'.format(n - 1)]
    for k in range(1, n):  # k significant digits still allowed
        rules += [f'bounded_int_{k} ::= "" | [0-9] bounded_int_{k - 1} | "." [0-9] bounded_sig_{k - 1}',
                  f'bounded_sig_{k} ::= "" | [0-9] bounded_sig_{k - 1}',
                  f'bounded_zeros_{k} ::= "0" | "0" bounded_zeros_{k - 1} | [1-9] bounded_sig_{n - 1}']
    rules += ['bounded_int_0 ::= ""', 'bounded_sig_0 ::= ""', f'bounded_zeros_0 ::= [1-9] bounded_sig_{n - 1}']
    rules += [f'bounded_digits_{k} ::= "" | [0-9] bounded_digits_{k - 1}' for k in range(1, MAX_INTEGER_DIGITS)]
    rules.append('bounded_digits_0 ::= ""')
    return "\n".join(rules) + "\n"


_RULES = {
    "basic_number": f'"-"? bounded_number_mantissa ([eE] [+\\-]? [0-9]{{1,{MAX_EXPONENT_DIGITS}}})?',
    "basic_integer": f'"-"? ("0" | [1-9] bounded_digits_{MAX_INTEGER_DIGITS - 1})',
}
_EXTRA = _digit_rules()


def _types(schema: dict) -> set:
    t = schema.get("type")
    return set(t) if isinstance(t, list) else {t}


def bound_schema(schema):
    """A copy of schema in which each one-sided integer or number range has its other side."""
    if isinstance(schema, list):
        return [bound_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else bound_schema(v) for k, v in schema.items()}
    types = _types(out)
    lower, upper = any(k in out for k in _LOWER), any(k in out for k in _UPPER)
    if lower != upper and types & {"integer", "number"} and not types - {"integer", "number", "null"}:
        low, high = (INT64_MIN, INT64_MAX) if types & {"integer"} and "number" not in types else \
            (-NUMBER_BOUND, NUMBER_BOUND)
        out.setdefault("maximum", high) if lower else out.setdefault("minimum", low)
    return out


def bounded_json_grammar(schema_text: str) -> str:
    """The EBNF of a JSON schema (compact, xgrammar's converter) with its numbers bounded.
    Raises what xgrammar raises on a bad schema."""
    import xgrammar as xgr

    schema = bound_schema(json.loads(schema_text))
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    for name, body in _RULES.items():
        ebnf = re.sub(rf"^{name} ::= .*$", lambda _m, n=name, b=body: f"{n} ::= {b}", ebnf, count=1, flags=re.M)
    return ebnf + _EXTRA
