"""OpenAI request bodies in (validated, as SamplingParams and a prompt); OpenAI bodies out.

Parsing is strict about what pagedserve uses (types, ranges, the model name) and
lenient about the rest: unknown fields such as `user` are ignored, so OpenAI clients
work unchanged (field_policy). Fields that would change the answer but are not implemented
are refused rather than silently ignored. The work a request asks for is held to the
gateway's RequestLimits (limits.py: samples, prompts, logprobs, lists, schema and grammar
sizes), passed in by the caller. Every rejection is an ApiError that renders as an
OpenAI-style error body naming the field (`param`).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from services.gateway.field_policy import unsupported_field
from services.gateway.limits import DEFAULT_LIMITS, LimitExceeded, RequestLimits, schema_json
from services.gateway.logprob_format import chat_logprobs, completion_logprobs, prompt_logprobs
from services.gateway.tools import (
    ToolError,
    ToolMode,
    extract_calls,
    extract_calls_off_loop,
    parse_tools,
    render_calls,
)
from shared.messages import (
    ChatMessage,
    ChatOptions,
    DetokenizeRequest,
    GenerateRequest,
    SamplingParams,
    StructuredOutput,
    TokenizeRequest,
    TokenLogprob,
    ToolCall,
)

# The default bounds (services/gateway/limits.py: each a flag of the gateway)
MAX_N = DEFAULT_LIMITS.max_n  # parallel samples or beams per request
MAX_PROMPTS = DEFAULT_LIMITS.max_prompts  # prompts in one /v1/completions batch
MAX_STOP_STRINGS = DEFAULT_LIMITS.max_stop
MAX_STOP_STRING_CHARS = DEFAULT_LIMITS.max_stop_chars
MAX_STOP_TOKEN_IDS = DEFAULT_LIMITS.max_stop_token_ids
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# Float ranges: wide enough for any real use, narrow enough that no stage's arithmetic
# overflows (a beam's score divides by length ** length_penalty).
MAX_TEMPERATURE = 100.0
MAX_LENGTH_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # as OpenAI
MAX_LOGIT_BIAS_ENTRIES = DEFAULT_LIMITS.max_logit_bias
MAX_ALLOWED_TOKEN_IDS = DEFAULT_LIMITS.max_allowed_token_ids
MAX_CACHE_SALT_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_INT64 = 2**63

# Fields each endpoint reads itself; the rest go through `field_policy`.
_COMMON_FIELDS = {
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "use_beam_search", "beam_width", "length_penalty", "return_token_ids",
    "stream", "stream_options", "n_predict", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "min_tokens", "allowed_token_ids", "logprobs", "prompt_logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "add_special_tokens", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "json_schema", "bad_words", "cache_salt",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                                "add_generation_prompt", "continue_final_message", "tools", "tool_choice"}
# apply_chat_template's own arguments: not template variables a client may set
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
MAX_LOGPROBS = DEFAULT_LIMITS.max_logprobs  # candidates per position, as vLLM's default max_logprobs


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.error_type, self.code = (
            message, status, param, error_type, code,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        }


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) alone
    chat: ChatOptions | None = None
    add_special_tokens: bool | None = None
    tool_mode: ToolMode | None = None  # chat with tools: how the answer becomes tool_calls
    batch: list[tuple[str | None, list[int] | None]] | None = None  # several prompts: (text, ids) each

    @property
    def num_prompts(self) -> int:
        return len(self.batch) if self.batch else 1

    def to_generate(self, request_id: str) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id, params=self.params, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, messages=self.messages, chat=self.chat,
            add_special_tokens=self.add_special_tokens,
        )

    def to_generates(self, request_id: str) -> list[GenerateRequest]:
        """One engine request per prompt of a batch (they share by prefix cache)."""
        if not self.batch:
            return [self.to_generate(request_id)]
        return [GenerateRequest(request_id=f"{request_id}-{i}", params=self.params, prompt=text, prompt_token_ids=ids,
                                add_special_tokens=self.add_special_tokens)
                for i, (text, ids) in enumerate(self.batch)]


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"The request body is not valid UTF-8: {exc}") from exc
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ApiError(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    try:  # JSON escapes can spell unpaired surrogates, which no stage could encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError("The request body holds a string that is not valid Unicode (an unpaired surrogate).") from exc
    return body


def parse_completion(body: dict, model_names: set[str], limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    _check_common(body, model_names, COMPLETION_FIELDS, limits)
    prompts = _prompts(body, limits)
    (prompt, prompt_ids), batch = prompts[0], (prompts if len(prompts) > 1 else None)
    echo = _boolean(body, "echo", False)
    echo_only = echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    # echo_only: the engine still runs one step (its token is dropped) to score the prompt
    max_tokens = 1 if echo_only else _max_tokens(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    stream, include_usage = _stream(body)
    logprobs = _logprob_count(body, "logprobs", limits)
    prompt_logprobs = _logprob_count(body, "prompt_logprobs", limits)
    if echo and logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    params = _with_logprobs(body, _sampling(body, max_tokens, limits), logprobs, prompt_logprobs, echo, limits)
    _check_work(params, [len(text if ids is None else ids) for text, ids in prompts], limits,
                "logprobs" if echo and logprobs is not None else "prompt_logprobs")
    return ParsedRequest(
        "completion", params, stream, include_usage, _boolean(body, "return_token_ids", False),
        prompt=prompt, prompt_token_ids=prompt_ids, echo_only=echo_only, batch=batch,
        add_special_tokens=_boolean(body, "add_special_tokens", None),
    )


def parse_chat(body: dict, model_names: set[str], limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    _check_common(body, model_names, CHAT_FIELDS, limits)
    messages = _messages(body)
    # default: the rest of the context, which the tokenizer stage works out (None)
    if body.get("max_completion_tokens") is not None:
        max_tokens = _max_tokens(body, "max_completion_tokens", None)
    else:
        max_tokens = _max_tokens(body, "max_tokens", None)
    stream, include_usage = _stream(body)
    wants = _boolean(body, "logprobs", False)
    top = _logprob_count(body, "top_logprobs", limits)
    if top is not None and not wants and top > 0:
        raise ApiError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    params = _with_logprobs(body, _sampling(body, max_tokens, limits), (top or 0) if wants else None,
                            _logprob_count(body, "prompt_logprobs", limits), False, limits)
    _check_work(params, [sum(len(m.content) for m in messages)], limits, "prompt_logprobs")
    try:
        tool_defs, tool_mode, tool_constraint = parse_tools(body, limits)
    except ToolError as exc:
        raise ApiError(str(exc), param=exc.param) from exc
    if tool_constraint is not None:
        if params.structured is not None:
            raise ApiError("A required or named tool_choice cannot be combined with another output constraint.",
                           param="tool_choice")
        if params.use_beam_search or params.ignore_eos:
            raise ApiError("'tool_choice' required or named cannot be combined with beam search or ignore_eos.",
                           param="tool_choice")
        params = msgspec.structs.replace(params, structured=tool_constraint)
    chat = msgspec.structs.replace(chat_options(body), tools=tool_defs)
    return ParsedRequest(
        "chat", params, stream, include_usage, _boolean(body, "return_token_ids", False),
        messages=messages, chat=chat, add_special_tokens=_boolean(body, "add_special_tokens", None),
        tool_mode=tool_mode,
    )


def _check_work(params: SamplingParams, prompt_lengths: list[int], limits: RequestLimits, logprobs_param: str) -> None:
    """The sequences a request starts, and the prompt logprobs it returns (a text prompt's
    length counted in characters, an upper bound of its tokens for common tokenizers)."""
    per_prompt = params.beam_width if params.use_beam_search else params.n
    sequences = len(prompt_lengths) * per_prompt
    if sequences > limits.max_sequences:
        each = "beam_width" if params.use_beam_search else "n"
        raise ApiError(f"This request would start {sequences} sequences (prompts x {each}); at most "
                       f"{limits.max_sequences}.", param=each)
    if params.prompt_logprobs is not None:
        entries = sum(prompt_lengths) * params.n * (params.prompt_logprobs + 1)
        if entries > limits.max_prompt_logprobs:
            raise ApiError(f"This request would return about {entries} prompt logprob entries (prompts x n x prompt "
                           f"length x (candidates + 1)); at most {limits.max_prompt_logprobs}: send fewer or shorter "
                           f"prompts, or fewer candidates.", param=logprobs_param)


def _structured(body: dict, limits: RequestLimits) -> StructuredOutput | None:
    """One constraint from OpenAI's response_format, vLLM's structured_outputs (or its older
    guided_* fields), or llama.cpp's json_schema; the tokenizer stage compiles it (400 if bad)."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _wrong_type("response_format", "an object", fmt)
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", StructuredOutput("json")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError("'response_format.json_schema.schema' must be a JSON schema object.",
                               param="response_format")
            found.append(("response_format", json_schema_constraint("response_format", schema, limits)))
        elif kind != "text":
            raise ApiError("'response_format.type' must be text, json_object or json_schema.", param="response_format")
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise _wrong_type("structured_outputs", "an object", outputs)
        for key in ("json", "regex", "choice", "grammar", "json_object"):
            if outputs.get(key) not in (None, False):
                found.append(("structured_outputs",
                              _constraint(f"structured_outputs.{key}", key, outputs[key], limits)))
    for key in ("json", "regex", "choice", "grammar"):
        if body.get(f"guided_{key}") is not None:
            found.append((f"guided_{key}", _constraint(f"guided_{key}", key, body[f"guided_{key}"], limits)))
    if body.get("json_schema") is not None:  # llama.cpp's
        found.append(("json_schema", _constraint("json_schema", "json", body["json_schema"], limits)))
    if len(found) > 1:
        raise ApiError(f"Only one output constraint may be given, not {found[0][0]} and {found[1][0]}.",
                       param=found[1][0])
    return found[0][1] if found else None


def _constraint(name: str, key: str, value, limits: RequestLimits) -> StructuredOutput:
    param = name.split(".")[0]
    if key == "json_object":
        return StructuredOutput("json")
    if key == "json":
        if isinstance(value, str):
            if len(value) > limits.max_schema_chars:
                raise _too_long(name, "schema", limits.max_schema_chars, param)
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise ApiError(f"'{name}' is not valid JSON: {exc}", param=param) from exc
        if not isinstance(value, dict):
            raise _wrong_type(name, "a JSON schema object", value)
        return json_schema_constraint(name, value, limits, param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(f"'{name}' must be a non-empty array of non-empty strings.", param=param)
        spec = json.dumps(value)
        if len(spec) > limits.max_grammar_chars:
            raise _too_long(name, "choice list", limits.max_grammar_chars, param)
        return StructuredOutput("choice", spec)
    if not isinstance(value, str) or not value:
        raise ApiError(f"'{name}' must be a non-empty string.", param=param)
    if len(value) > limits.max_grammar_chars:
        raise _too_long(name, key, limits.max_grammar_chars, param)
    return StructuredOutput(key, value)


def json_schema_constraint(name: str, schema: dict, limits: RequestLimits, param: str | None = None) -> StructuredOutput:
    try:
        return StructuredOutput("json_schema", schema_json(schema, limits))
    except LimitExceeded as exc:
        raise ApiError(f"The schema of '{name}' {exc}.", param=param or name) from exc


def _too_long(name: str, what: str, limit: int, param: str) -> ApiError:
    return ApiError(f"'{name}': the {what} is longer than {limit} characters.", param=param)


def parse_tokenize(body: dict, model_names: set[str], request_id: str) -> TokenizeRequest:
    """vLLM's /tokenize: a prompt, or chat messages with the chat fields."""
    _check_model(body, model_names)
    add_special = _boolean(body, "add_special_tokens", None)
    strs = _boolean(body, "return_token_strs", False)
    if body.get("messages") is not None:
        return TokenizeRequest(request_id, messages=_messages(body), chat=chat_options(body),
                               add_special_tokens=add_special, return_token_strs=strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _wrong_type("prompt", "a string (or send 'messages')", prompt)
    return TokenizeRequest(request_id, prompt=prompt, add_special_tokens=add_special, return_token_strs=strs)


def parse_detokenize(body: dict, model_names: set[str], request_id: str) -> DetokenizeRequest:
    _check_model(body, model_names)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
        raise _wrong_type("tokens", "an array of token ids", tokens)
    return DetokenizeRequest(request_id, tokens)


def chat_options(body: dict) -> ChatOptions:
    """vLLM's chat fields: add_generation_prompt, continue_final_message, chat_template_kwargs."""
    add = _boolean(body, "add_generation_prompt", True)
    cont = _boolean(body, "continue_final_message", False)
    if add and cont:
        raise ApiError("'continue_final_message' needs 'add_generation_prompt': false.", param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise _wrong_type("chat_template_kwargs", "an object", kwargs)
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    return ChatOptions(add_generation_prompt=add, continue_final_message=cont, template_kwargs=kwargs)


def _logprob_count(body: dict, name: str, limits: RequestLimits) -> int | None:
    value = _integer(body, name, None)
    if value is not None and not 0 <= value <= limits.max_logprobs:
        raise ApiError(f"'{name}' must be between 0 and {limits.max_logprobs}, got {value}.", param=name)
    return value


def _with_logprobs(body: dict, params: SamplingParams, logprobs: int | None, prompt_logprobs: int | None,
                   echo: bool, limits: RequestLimits) -> SamplingParams:
    if params.use_beam_search and (logprobs is not None or prompt_logprobs is not None):
        name = "logprobs" if logprobs is not None else "prompt_logprobs"
        raise ApiError(f"'{name}' cannot be combined with beam search.", param=name)
    structured = _structured(body, limits)
    if structured is not None and (params.use_beam_search or params.ignore_eos):
        name = "use_beam_search" if params.use_beam_search else "ignore_eos"
        raise ApiError(f"'{name}' cannot be combined with structured output.", param=name)
    return msgspec.structs.replace(
        params, logprobs=logprobs, prompt_logprobs=prompt_logprobs, echo=echo, structured=structured,
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        spaces_between_special_tokens=_boolean(body, "spaces_between_special_tokens", True))


# --- field readers --------------------------------------------------------------------


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _wrong_type(name: str, expected: str, value) -> ApiError:
    return ApiError(f"'{name}' must be {expected}, not {_type_name(value)}.", param=name)


def _integer(body: dict, name: str, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(name, "an integer", value)
    if not -_INT64 <= value < _INT64:
        raise ApiError(f"'{name}' is out of range.", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite number in [low, high]."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, "a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer too big for a float
        number = math.inf
    if not math.isfinite(number):
        raise ApiError(f"'{name}' must be a finite number.", param=name)
    if not low <= number <= high:
        raise ApiError(f"'{name}' must be between {low:g} and {high:g}, got {number:g}.", param=name)
    return number


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong_type(name, "a boolean", value)
    return value


def _check_common(body: dict, model_names: set[str], known: set[str], limits: RequestLimits) -> None:
    _check_model(body, model_names)
    _check_fields(body, known, limits)


def _check_model(body: dict, model_names: set[str]) -> None:
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _wrong_type("model", "a string", model)
        if model not in model_names:
            served = ", ".join(public_model_names(model_names))
            raise ApiError(
                f"The model `{model}` does not exist. This server serves: {served}.", 404,
                param="model", code="model_not_found",
            )


def _check_fields(body: dict, known: set[str], limits: RequestLimits) -> None:
    n = _integer(body, "n", 1)
    if not 1 <= n <= limits.max_n:
        raise ApiError(f"'n' must be between 1 and {limits.max_n}, got {n}.", param="n")
    refused = unsupported_field(body, known)
    if refused is not None:
        raise ApiError(f"'{refused}' is not supported by this server: it would change the answer, so it is "
                       f"refused rather than ignored.", param=refused)


def public_model_names(model_names) -> list[str]:
    """The names a client may be shown: a model given as a file path is the server's business."""
    return sorted(n for n in model_names if not os.path.isabs(n))


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    if body.get(name) is None and name == "max_tokens" and body.get("n_predict") is not None:
        value = _integer(body, "n_predict", None)  # llama.cpp's name; -1 means no limit
        if value == -1:
            return None
        name = "n_predict"
    else:
        value = _integer(body, name, default)
    if value is not None and value < 1:
        raise ApiError(f"'{name}' must be at least 1, got {value}.", param=name)
    return value


def _sampling(body: dict, max_tokens: int, limits: RequestLimits) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ApiError(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p")
    top_k = _integer(body, "top_k", 0)
    if top_k < -1:
        raise ApiError(f"'top_k' must be -1 or 0 (no cut) or positive, got {top_k}.", param="top_k")
    n = _integer(body, "n", 1)
    beam = _boolean(body, "use_beam_search", False)
    beam_width = _integer(body, "beam_width", max(n, 4) if beam else 4)
    if beam and not n <= beam_width <= limits.max_n:
        raise ApiError(f"'beam_width' must be between n ({n}) and {limits.max_n}, got {beam_width}.",
                       param="beam_width")
    return SamplingParams(
        n=n,
        use_beam_search=beam,
        beam_width=beam_width,
        length_penalty=_number(body, "length_penalty", 1.0, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=_integer(body, "seed", None),
        stop=_stop(body, limits),
        stop_token_ids=_token_id_list(body, "stop_token_ids", limits.max_stop_token_ids),
        ignore_eos=_boolean(body, "ignore_eos", False),
        include_stop_str_in_output=_boolean(body, "include_stop_str_in_output", False),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=_repetition_penalty(body),
        logit_bias=_logit_bias(body, limits),
        min_tokens=_min_tokens(body, max_tokens),
        allowed_token_ids=_token_id_list(body, "allowed_token_ids", limits.max_allowed_token_ids, allow_empty=False),
        bad_words=_bad_words(body, limits),
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt: requests with different salts never share cached KV blocks."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters.",
                       param="cache_salt")
    return salt


def _bad_words(body: dict, limits: RequestLimits) -> list[str]:
    words = body.get("bad_words")
    if words is None:
        return []
    if isinstance(words, str):
        words = [words]
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise _wrong_type("bad_words", "an array of non-empty strings", words)
    if len(words) > limits.max_bad_words or sum(map(len, words)) > limits.max_bad_words_chars:
        raise ApiError(f"At most {limits.max_bad_words} bad_words of {limits.max_bad_words_chars} characters "
                       f"together.", param="bad_words")
    return words


def _repetition_penalty(body: dict) -> float:
    value = _number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
    if value <= 0:
        raise ApiError("'repetition_penalty' must be above 0 (1 = none).", param="repetition_penalty")
    return value


def _logit_bias(body: dict, limits: RequestLimits) -> list[tuple[int, float]]:
    """OpenAI's {"token id": bias}; the ids are checked against the vocabulary by the tokenizer stage."""
    bias = body.get("logit_bias")
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise _wrong_type("logit_bias", "an object mapping token ids to numbers", bias)
    if len(bias) > limits.max_logit_bias:
        raise ApiError(f"'logit_bias' has more than {limits.max_logit_bias} entries.", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise ApiError(f"'logit_bias' keys must be token ids, got {key[:20]!r}.", param="logit_bias")
        out.append((int(key), _number({"logit_bias": value}, "logit_bias", 0.0, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
    return sorted(out)


def _min_tokens(body: dict, max_tokens: int | None) -> int:
    value = _integer(body, "min_tokens", 0)
    if value < 0 or (max_tokens is not None and value > max_tokens):
        raise ApiError(f"'min_tokens' must be between 0 and max_tokens, got {value}.", param="min_tokens")
    return value


def _token_id_list(body: dict, name: str, limit: int, allow_empty: bool = True) -> list[int]:
    ids = body.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
        raise _wrong_type(name, "an array of token ids", ids)
    if not ids and not allow_empty:
        raise ApiError(f"'{name}' must not be empty.", param=name)
    if len(ids) > limit:
        raise ApiError(f"Too many {name}: {len(ids)}, at most {limit}.", param=name)
    return ids


def _stop(body: dict, limits: RequestLimits) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _wrong_type("stop", "a string or an array of strings", stop)
    if len(stop) > limits.max_stop:
        raise ApiError(f"Too many stop strings: {len(stop)}, at most {limits.max_stop}.", param="stop")
    for s in stop:
        if not s or len(s) > limits.max_stop_chars:
            raise ApiError(f"Each stop string must have 1 to {limits.max_stop_chars} characters.", param="stop")
    return stop


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _INT64


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    if not stream:
        raise ApiError("'stream_options' can only be set when 'stream' is true.", param="stream_options")
    return stream, _boolean(options, "include_usage", True)  # as vLLM: options given mean usage wanted


def _prompts(body: dict, limits: RequestLimits) -> list[tuple[str | None, list[int] | None]]:
    """Each prompt as (text, None) or (None, token ids): one prompt, or a batch of them."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required.", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise ApiError(f"Too many prompts in a batch: {len(prompt)}, at most {limits.max_prompts}.",
                           param="prompt")
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt(prompt, "prompt")]


def _prompt(prompt, where: str) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(f"'{where}' must not be empty.", param="prompt")
        return prompt, None
    if not isinstance(prompt, list):
        raise _wrong_type("prompt", "a string, an array of token ids, or an array of those", prompt)
    if not prompt:
        raise ApiError(f"'{where}' must not be empty.", param="prompt")
    if all(_is_token_id(t) for t in prompt):
        return None, prompt
    raise ApiError(f"'{where}' token ids must be non-negative integers.", param="prompt")


def _messages(body: dict) -> list[ChatMessage]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError("'messages' is required.", param="messages")
    if not isinstance(messages, list):
        raise _wrong_type("messages", "an array", messages)
    if not messages:
        raise ApiError("'messages' must hold at least one message.", param="messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, msg) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _wrong_type(where, "an object", msg)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}.", param=where)
    content = msg.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise _wrong_type(f"{where}.content", "a string or an array of text parts", content)
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list) or (calls and role != "assistant"):
        raise ApiError(f"{where}.tool_calls must be an array, on an assistant message.", param=where)
    tool_calls = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    call_id, name = msg.get("tool_call_id"), msg.get("name")
    if not isinstance(call_id, (str, type(None))) or not isinstance(name, (str, type(None))):
        raise ApiError(f"{where}.tool_call_id and name must be strings.", param=where)
    return ChatMessage(role=role, content=content, tool_calls=tool_calls, tool_call_id=call_id, name=name)


def _tool_call(where: str, call) -> ToolCall:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                       f"\"arguments\"}}}}.", param=where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=args)


def _text_part(where: str, part) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else _type_name(part)
        raise ApiError(
            f"{where} must be a text part {{\"type\": \"text\", \"text\": ...}}; "
            f"only text content is supported, not {kind!r}.", param=where,
        )
    return part["text"]


# --- responses ------------------------------------------------------------------------


def new_request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ChoiceState:
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # whole responses: every token's
    text_offset: int = 0  # streamed completions: where the next token's text starts
    prompt_text: str | None = None  # echo
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    started: bool = False  # its first chunk went out (a stream echoes the prompt there)
    held: str = ""  # a stream with tools: the text so far, sent (as calls or text) at the end
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class ResponseBuilder:
    """The bodies of one request's answer: the whole object, or its stream of chunks.

    With return_token_ids, each choice also lists its generated token ids (in a stream,
    the ones new in that chunk). With logprobs (params.logprobs set), each choice, or each
    chunk, has them in the endpoint's shape (see logprob_format); with echo, a completion's
    text (and logprobs) starts with the prompt's; echo_only drops the one token the engine
    ran to score the prompt. Choices of a batch of prompts are numbered prompt * n + sample.
    """

    def __init__(
        self, kind: str, request_id: str, model: str, include_usage: bool = False, return_token_ids: bool = False,
        num_choices: int = 1, params: SamplingParams | None = None, echo_only: bool = False,
        tool_mode: ToolMode | None = None,
    ):
        self.kind, self.id, self.model = kind, request_id, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(num_choices)]
        params = params or SamplingParams()
        self.logprobs = params.logprobs is not None
        self.prompt_logprobs = params.prompt_logprobs is not None and not (params.echo and self.logprobs)
        self.echo, self.echo_only = params.echo, echo_only
        self.n = params.n if num_choices % params.n == 0 else 1
        # with tools (other than tool_choice none) a choice's text is parsed for calls when it ends
        self.tool_mode = tool_mode if tool_mode is not None and tool_mode.choice != "none" else None
        self._calls: dict[int, tuple[str | None, list[ToolCall]]] = {}  # by choice, parsed ahead off the loop

    async def parse_calls(self, index: int, text: str) -> None:
        """Find a finished choice's tool calls ahead of full() or its last chunk(), off the event
        loop when the text is long; text is the whole answer (a stream: what is held plus the last delta)."""
        if self.tool_mode is not None:
            self._calls[index] = await extract_calls_off_loop(self.tool_mode, text)

    def _extract_calls(self, index: int, text: str) -> tuple[str | None, list[ToolCall]]:
        found = self._calls.pop(index, None)
        return found if found is not None else extract_calls(self.tool_mode, text)

    def record(self, msg) -> bool:
        """Note a TextDelta's counts; True once every choice has finished."""
        choice = self.choices[msg.seq_index]
        choice.num_output_tokens = 0 if self.echo_only else msg.num_output_tokens
        choice.num_prompt_tokens = msg.num_prompt_tokens
        choice.num_cached_tokens = max(choice.num_cached_tokens, msg.num_cached_tokens)
        if msg.finish_reason is not None:
            choice.finish_reason = msg.finish_reason
            choice.stop_reason = msg.stop_reason
        if msg.prompt_text is not None:
            choice.prompt_text = msg.prompt_text
        if msg.prompt_logprobs:  # sent on one delta of a prompt's n: each of its choices has them
            base = msg.seq_index - msg.seq_index % self.n
            for sibling in self.choices[base : base + self.n]:
                sibling.prompt_logprobs = msg.prompt_logprobs
        if self.logprobs and not self.echo_only:
            choice.logprobs += msg.logprobs
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def usage(self) -> dict:
        """Prompt tokens count once per prompt (its n choices share it)."""
        firsts = self.choices[:: self.n]
        out = usage(sum(c.num_prompt_tokens for c in firsts), self.num_output_tokens)
        out["prompt_tokens_details"] = {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}
        return out

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _finish(self, choice: dict, finish_reason: str | None, token_ids: list[int], state: ChoiceState | None = None,
                logprobs: dict | None = None) -> dict:
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if finish_reason is not None:
            choice["stop_reason"] = state.stop_reason if state is not None else None
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _echo_entries(self, state: ChoiceState) -> list[TokenLogprob]:
        return state.prompt_logprobs if self.echo and self.logprobs else []

    def _logprobs(self, state: ChoiceState, entries: list[TokenLogprob], first: bool) -> dict | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        if first:
            entries = self._echo_entries(state) + entries
        out, state.text_offset = completion_logprobs(entries, state.text_offset)
        return out

    def full(self, choices: list[tuple[str, str | None, list[int]]], usage_: dict) -> dict:
        """choices: (text, finish_reason, token_ids) by choice index."""
        out = []
        for index, (text, finish_reason, token_ids) in enumerate(choices):
            state = self.choices[index] if index < len(self.choices) else ChoiceState()
            if self.echo_only:
                text, token_ids, finish_reason = "", [], "length"
            if self.kind == "chat":
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
                if self.tool_mode is not None:
                    content, calls = self._extract_calls(index, text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content,
                                             "tool_calls": render_calls(calls)}
                        finish_reason = self._tool_finish(finish_reason)
            else:
                choice = {"index": index, "text": (state.prompt_text or "") + text if self.echo else text}
            state.text_offset = 0
            self._finish(choice, finish_reason, list(token_ids), state, self._logprobs(state, state.logprobs, True))
            if self.prompt_logprobs and self.kind != "chat":
                choice["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs)
            out.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = {**self._envelope(obj, out), "usage": usage_}
        if self.prompt_logprobs and self.kind == "chat":
            body["prompt_logprobs"] = prompt_logprobs(self.choices[0].prompt_logprobs)
        return body

    def chunk(
        self, text: str, finish_reason: str | None = None, role: bool = False, token_ids: list[int] = (),
        index: int = 0, logprobs: list[TokenLogprob] = (),
    ) -> dict | None:
        """One SSE chunk, or None while a choice with tools holds its text back."""
        state = self.choices[index] if index < len(self.choices) else ChoiceState()
        first = not state.started and not role
        if not role:
            state.started = True
        if self.echo_only:
            text, token_ids, logprobs = "", [], []
            finish_reason = "length" if finish_reason is not None else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            if self.tool_mode is not None and not role:
                state.held += text
                if finish_reason is None:
                    return None  # held until the end: calls or text
                content, calls = self._extract_calls(index, state.held)
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = render_calls(calls, stream=True)
                    finish_reason = self._tool_finish(finish_reason)
            choice, obj = {"index": index, "delta": delta}, "chat.completion.chunk"
        else:
            if first and self.echo:
                text = (state.prompt_text or "") + text
            choice, obj = {"index": index, "text": text}, "text_completion"
        lp = None if role else self._logprobs(state, list(logprobs), first)
        self._finish(choice, finish_reason, list(token_ids), state, lp)
        if first and self.prompt_logprobs and self.kind != "chat":
            choice["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs)
        out = self._envelope(obj, [choice])
        if first and self.prompt_logprobs and self.kind == "chat" and index == 0:
            out["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs)
        if self.include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def _tool_finish(finish_reason: str | None) -> str | None:
        """Calls end a choice with "tool_calls", unless max_tokens cut it short."""
        return "tool_calls" if finish_reason == "stop" else finish_reason

    def usage_chunk(self, usage_: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_}
