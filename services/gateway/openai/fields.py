"""Every request field of the OpenAI endpoints, declared once: its JSON schema (type, range, sizes),
the endpoints that read it, and what happens when it is sent to a generation endpoint that does not.

From this one table:
- the parsers take their numeric ranges (`bounds`) and their size bounds (the same RequestLimits
  fields): a value outside them is a 400 naming it;
- the field policy (field_policy.py) knows which fields an endpoint reads (`known_fields`) and
  which other ones it refuses (`refused_elsewhere`) or ignores (`ignored_elsewhere`);
- /openapi.json (openapi.py) states each endpoint's body (`request_schema`).
A bound that is a gateway flag is written `Limit("max_n")`: the value of that field of the
RequestLimits the gateway runs with (services/gateway/limits.py); `MODEL_NAMES` stands for the
names the gateway serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.limits import DEFAULT_LIMITS, RequestLimits

COMPLETION, CHAT, TOKENIZE, DETOKENIZE = "completion", "chat", "tokenize", "detokenize"
GENERATION = frozenset({COMPLETION, CHAT})  # the endpoints the field policy applies to
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Float ranges: wide enough for any real use, narrow enough that no stage's arithmetic
# overflows (a beam's score divides by length ** length_penalty).
MAX_TEMPERATURE = 100.0
MAX_LENGTH_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # as OpenAI
MAX_CACHE_SALT_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Limit:
    """A bound that is the gateway's RequestLimits field of this name."""

    name: str


MODEL_NAMES = Limit("model_names")


@dataclass(frozen=True)
class Field:
    name: str
    schema: dict  # JSON schema (OpenAPI 3.0), null allowed too unless nullable is False
    on: frozenset[str]  # the endpoints that read it
    nullable: bool = True
    required_on: frozenset[str] = frozenset()  # the endpoints that need it
    # sent to a generation endpoint that does not read it: refused unless null, false, empty or one
    # of these values (refused_elsewhere), or accepted silently (ignored_elsewhere); else logged
    refused_elsewhere: tuple | None = None
    ignored_elsewhere: bool = False

    def resolved(self, limits: RequestLimits, model_names: list[str] = ()) -> dict:
        schema = _resolve(self.schema, limits, list(model_names))
        return {**schema, "nullable": True} if self.nullable else schema


def _resolve(schema, limits: RequestLimits, model_names: list[str]):
    if isinstance(schema, Limit):
        return model_names if schema == MODEL_NAMES else getattr(limits, schema.name)
    if isinstance(schema, dict):
        return {k: _resolve(v, limits, model_names) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_resolve(v, limits, model_names) for v in schema]
    return schema


def _integer(low: int, high, description: str | None = None) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high, **({"description": description} if description else {})}


def _number(low: float, high: float, exclusive_low: bool = False) -> dict:
    return {"type": "number", **({"exclusiveMinimum": True} if exclusive_low else {}), "minimum": low, "maximum": high}


_BOOLEAN = {"type": "boolean"}
_OBJECT = {"type": "object"}
_STRING = {"type": "string"}
_JSON = {"oneOf": [_OBJECT, _STRING]}  # a schema, or its text
_STRINGS = {"type": "array", "items": _STRING}
_TOKEN_ID = _integer(0, INT64_MAX)
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": Limit("max_stop_chars")}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STRING}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": list(CHAT_ROLES)},
    "content": {"oneOf": [_STRING, {"type": "array", "items": _TEXT_PART}], "nullable": True},
    "name": _STRING,
    "tool_call_id": _STRING,
    "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
        "id": _STRING, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": _STRING, "arguments": _STRING}}}}},
}}
_PROMPT = [{"type": "string", "minLength": 1}, _TOKEN_IDS]
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": _STRING, "parameters": _OBJECT}}}}
_NAMED_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {"name": _STRING}}}}

_GEN, _C, _CH = GENERATION, frozenset({COMPLETION}), frozenset({CHAT})
_TEMPLATED = frozenset({CHAT, TOKENIZE})  # chat messages rendered by the template
FIELDS: tuple[Field, ...] = (
    Field("model", {"type": "string", "enum": MODEL_NAMES}, _GEN | {TOKENIZE, DETOKENIZE}),
    # /v1/completions
    Field("prompt", {"oneOf": [*_PROMPT, {"type": "array", "minItems": 1, "maxItems": Limit("max_prompts"),
                                          "items": {"oneOf": _PROMPT},
                                          "description": "a batch: choice index = prompt * n + sample"}]},
          _C, nullable=False, required_on=_C),
    Field("echo", {**_BOOLEAN, "description": "with max_tokens 0: the prompt alone, scored"}, _C,
          refused_elsewhere=()),  # vLLM's echo on chat is not built
    Field("logprobs", _integer(0, Limit("max_logprobs")), _C),
    # /v1/chat/completions
    Field("messages", {"type": "array", "minItems": 1, "items": _MESSAGE}, _TEMPLATED, nullable=False,
          required_on=_CH),
    Field("logprobs", _BOOLEAN, _CH),
    Field("top_logprobs", _integer(0, Limit("max_logprobs")), _CH),
    Field("add_generation_prompt", _BOOLEAN, _TEMPLATED),
    Field("continue_final_message", {**_BOOLEAN, "description": "needs add_generation_prompt false"}, _TEMPLATED),
    Field("chat_template_kwargs", {**_OBJECT, "description": "variables for the chat template"}, _TEMPLATED),
    Field("tools", {"type": "array", "maxItems": Limit("max_tools"), "items": _TOOL}, _CH, refused_elsewhere=()),
    Field("tool_choice", {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, _NAMED_TOOL]}, _CH,
          refused_elsewhere=("none", "auto")),
    Field("parallel_tool_calls", _BOOLEAN, _CH, ignored_elsewhere=True),
    Field("max_completion_tokens", _integer(1, INT64_MAX), _CH),
    Field("include_reasoning", {**_BOOLEAN, "description": "vLLM's: with --reasoning-parser, show the thinking as "
                                "reasoning_content (false: drop it)"}, _CH, ignored_elsewhere=True),
    # both: sampling, stopping, output
    Field("max_tokens", _integer(0, INT64_MAX, "0 only with echo (prompt scoring)"), _GEN),
    Field("n_predict", _integer(-1, INT64_MAX, "llama.cpp's max_tokens; -1: the rest of the context"), _GEN),
    Field("temperature", _number(0, MAX_TEMPERATURE), _GEN),
    Field("top_p", _number(0, 1, exclusive_low=True), _GEN),
    Field("top_k", _integer(-1, INT64_MAX), _GEN),
    Field("seed", _integer(-(2**63), INT64_MAX), _GEN),
    Field("n", _integer(1, Limit("max_n")), _GEN),
    Field("use_beam_search", _BOOLEAN, _GEN),
    Field("beam_width", _integer(1, Limit("max_n")), _GEN),
    Field("length_penalty", _number(-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY), _GEN),
    Field("min_p", _number(0, 1), _GEN),
    Field("presence_penalty", _number(-MAX_PENALTY, MAX_PENALTY), _GEN),
    Field("frequency_penalty", _number(-MAX_PENALTY, MAX_PENALTY), _GEN),
    Field("repetition_penalty", _number(0, MAX_REPETITION_PENALTY, exclusive_low=True), _GEN),
    Field("logit_bias", {"type": "object", "maxProperties": Limit("max_logit_bias"),
                         "description": "token id (as a string) -> bias added to its logit",
                         "additionalProperties": _number(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)}, _GEN),
    Field("min_tokens", _integer(0, INT64_MAX, "at most max_tokens; EOS and stop_token_ids are masked until then"),
          _GEN),
    Field("allowed_token_ids", {"type": "array", "minItems": 1, "maxItems": Limit("max_allowed_token_ids"),
                                "items": _TOKEN_ID}, _GEN),
    Field("stop", {"oneOf": [_STOP_STRING, {"type": "array", "maxItems": Limit("max_stop"), "items": _STOP_STRING}]},
          _GEN),
    Field("stop_token_ids", {"type": "array", "maxItems": Limit("max_stop_token_ids"), "items": _TOKEN_ID}, _GEN),
    Field("ignore_eos", _BOOLEAN, _GEN),
    Field("speculative", {**_BOOLEAN, "description": "false: never speculated (--speculative), whatever the "
                                                    "engine's setting; the output is the same either way"}, _GEN),
    Field("include_stop_str_in_output", _BOOLEAN, _GEN),
    Field("return_token_ids", _BOOLEAN, _GEN),
    Field("response_format", {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": _STRING, "schema": _OBJECT,
                                                         "strict": {**_BOOLEAN, "nullable": True}}}}}, _GEN),
    Field("guided_json", _JSON, _GEN),
    Field("guided_regex", _STRING, _GEN),
    Field("guided_choice", _STRINGS, _GEN),
    Field("guided_grammar", _STRING, _GEN),
    Field("json_schema", {**_OBJECT, "description": "llama.cpp's: the output's JSON schema"}, _GEN),
    Field("structured_outputs", {"type": "object", "description": "vLLM's: one of json, regex, choice, grammar "
                                 "(xgrammar EBNF), json_object", "properties": {
        "json": _JSON, "regex": _STRING, "choice": _STRINGS, "grammar": _STRING, "json_object": _BOOLEAN,
        "unbounded_numbers": {**_BOOLEAN, "description": "pagedserve's: JSON numbers of any length (by default "
                              "17 significant digits and a 3-digit exponent, integers as the schema's bounds "
                              "or int64 allow); goes with any output constraint field"}}}, _GEN),
    Field("skip_special_tokens", _BOOLEAN, _GEN),
    Field("bad_words", {"type": "array", "maxItems": Limit("max_bad_words"), "items": {
        "type": "string", "minLength": 1, "maxLength": Limit("max_bad_words_chars"), "pattern": "\\S"}}, _GEN),
    Field("spaces_between_special_tokens", _BOOLEAN, _GEN),
    Field("add_special_tokens", _BOOLEAN, _GEN | {TOKENIZE}),
    Field("prompt_logprobs", _integer(0, Limit("max_logprobs"),
                                      "vLLM's: each prompt token's logprob and this many top ones"), _GEN),
    Field("stream", _BOOLEAN, _GEN),
    Field("stream_options", {"type": "object", "properties": {"include_usage": _BOOLEAN}}, _GEN),
    Field("cache_salt", {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                         "description": "vLLM's: requests with different salts share no cached KV"}, _GEN),
    Field("priority", _integer(-(2**63), INT64_MAX, "vLLM's: lower is served first, ties by arrival (needs "
                               "--scheduling-policy priority; under fcfs only 0)"), _GEN, refused_elsewhere=(0,)),
    Field("user", _STRING, _GEN, nullable=False),  # read by nobody: it does not change the answer
    # /tokenize, /detokenize
    Field("prompt", _STRING, frozenset({TOKENIZE}), nullable=False),
    Field("return_token_strs", _BOOLEAN, frozenset({TOKENIZE})),
    Field("tokens", {"type": "array", "items": _TOKEN_ID}, frozenset({DETOKENIZE}), nullable=False,
          required_on=frozenset({DETOKENIZE})),
)


def fields_of(endpoint: str) -> list[Field]:
    return [f for f in FIELDS if endpoint in f.on]


def known_fields(endpoint: str) -> frozenset[str]:
    return frozenset(f.name for f in fields_of(endpoint))


def refused_elsewhere(endpoint: str) -> dict[str, tuple]:
    """The fields other generation endpoints read that this one refuses unless "not used"."""
    return {f.name: f.refused_elsewhere for f in FIELDS if f.refused_elsewhere is not None and endpoint not in f.on}


def ignored_elsewhere(endpoint: str) -> frozenset[str]:
    return frozenset(f.name for f in FIELDS if f.ignored_elsewhere and endpoint not in f.on)


def bounds(name: str, limits: RequestLimits = DEFAULT_LIMITS) -> tuple:
    """(minimum, maximum) of the numeric field of this name (of /v1/completions where the
    endpoints differ: its `logprobs` is a count, chat's a boolean), as the parser holds it."""
    schema = _NUMERIC[name]
    return _resolve(schema["minimum"], limits, []), _resolve(schema["maximum"], limits, [])


_NUMERIC: dict[str, dict] = {}
for _f in FIELDS:
    if "maximum" in _f.schema:
        _NUMERIC.setdefault(_f.name, _f.schema)


def request_schema(endpoint: str, limits: RequestLimits, model_names: list[str]) -> dict:
    """The JSON schema of one endpoint's body; model_names are the `model` field's enum."""
    fields = fields_of(endpoint)
    schema = {"type": "object", "properties": {f.name: f.resolved(limits, model_names) for f in fields}}
    required = [f.name for f in fields if endpoint in f.required_on]
    return {**schema, "required": required} if required else schema
