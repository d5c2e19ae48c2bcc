"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

The tools go to the tokenizer stage, whose chat template renders them (see
services/tokenizer/tool_prompt.py for templates without tool support). Then:
- `tool_choice: "none"`: the model answers in text; nothing is parsed;
- `"auto"` (the default with tools): the answer is parsed for Hermes-style calls,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; any found become
  `tool_calls` (finish_reason "tool_calls") and the text around them the content;
- `"required"`: the grammar engine constrains the answer to a JSON array of one call
  (several with parallel_tool_calls) `{"name": <a tool>, "arguments": <its schema>}`,
  as vLLM does, so the model always makes valid calls;
- a named function: the answer is constrained to that function's arguments schema.
A stream with tools holds its text back and sends the calls (or the text) at the end,
one delta per call with its id, name and whole arguments.

Finding the calls is one linear scan (str.find for the tags; the regex it replaces, lazy between
two runs of whitespace, was cubic in them), over at most MAX_PARSED_CHARS (a longer answer stays
text), and a call whose JSON is nested too deep to decode is text too, never an error.
`extract_calls_off_loop` runs it, and its json.loads, on a worker thread when the answer is
long (OFF_LOOP_CHARS), so one long answer cannot hold up the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass

from services.gateway.limits import DEFAULT_LIMITS, LimitExceeded, RequestLimits, schema_json
from shared.messages import StructuredOutput, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARSED_CHARS = 4 * 1024 * 1024  # an answer longer than this is not parsed for calls
OFF_LOOP_CHARS = 64 * 1024  # answers longer than this are parsed on a worker thread


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "none", "auto", "required" or "named"
    tools: tuple[str, ...]  # names
    named: str | None = None

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def parse_tools(body: dict, limits: RequestLimits = DEFAULT_LIMITS
                ) -> tuple[list[dict], ToolMode | None, StructuredOutput | None]:
    """(tool definitions for the template, the mode, the output constraint); ToolError if bad
    or past the limits (tools count, each one's parameters schema, the constraint built)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'.", "tool_choice")
        return [], None, None
    if not isinstance(tools, list) or len(tools) > limits.max_tools:
        raise ToolError(f"'tools' must be an array of at most {limits.max_tools} tools.", "tools")
    defs, schemas = [], {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or name in schemas:
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                            f"with a unique name.", "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        _bounded(f"tools[{i}].function.parameters", params, limits, "tools")
        schemas[name] = params
        defs.append({"type": "function", "function": {"name": name, "description": fn.get("description") or "",
                                                      "parameters": params}})
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    names = tuple(schemas)
    if choice is None or choice == "auto":
        return defs, ToolMode("auto", names), None
    if choice == "none":
        return defs, ToolMode("none", names), None
    if choice == "required":
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": s},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for n, s in schemas.items()]}
        array = {"type": "array", "items": call, "minItems": 1, **({} if parallel is not False else {"maxItems": 1})}
        return defs, ToolMode("required", names), StructuredOutput(
            "json_schema", _bounded("the schema of tool_choice required", array, limits, "tool_choice"))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in schemas:
        raise ToolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": <one of the tools>}}.", "tool_choice")
    return defs, ToolMode("named", names, name), StructuredOutput("json_schema", json.dumps(schemas[name]))


def _bounded(name: str, schema: dict, limits: RequestLimits, param: str) -> str:
    try:
        return schema_json(schema, limits)
    except LimitExceeded as exc:
        raise ToolError(f"{name} {exc}.", param) from exc


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _loads(text: str):
    """The JSON value of text, or None where it is not JSON or nested too deep to decode. Raw
    control characters inside strings are taken (strict=False): a constrained call of a small
    model was seen with one; the arguments are dumped again, escaped, before they leave."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return None


def split_calls(text: str) -> tuple[list[str], str]:
    """(the stripped text inside each <tool_call>...</tool_call>, the text outside them), in one
    pass: each tag is looked for once from where the last one ended; an unclosed tag is text."""
    blocks, outside, pos = [], [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        outside.append(text[pos:start])
        blocks.append(text[start + len(OPEN):end].strip())
        pos = end + len(CLOSE)
    outside.append(text[pos:])
    return blocks, "".join(outside)


def extract_calls(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer; what is not a valid call stays text."""
    if mode.choice == "named":
        return None, [ToolCall(_new_id(), mode.named, text)]
    if mode.choice == "none" or len(text) > MAX_PARSED_CHARS:
        return text, []
    if mode.choice == "required":
        calls = _loads(text)  # None when cut short by max_tokens: the text as it is
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  and "arguments" in c for c in calls):
            return text, []
        return None, [ToolCall(_new_id(), c["name"], _arguments(c["arguments"])) for c in calls]
    blocks, rest = split_calls(text)
    calls = []
    for block in blocks:
        call = _loads(block)
        if isinstance(call, dict) and call.get("name") in mode.tools:
            calls.append(ToolCall(_new_id(), call["name"], _arguments(call.get("arguments", {}))))
    if not calls:
        return text, []
    return rest.strip() or None, calls


async def extract_calls_off_loop(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """extract_calls, on the default executor's thread when text is long."""
    if len(text) <= OFF_LOOP_CHARS or mode.choice in ("none", "named"):
        return extract_calls(mode, text)
    return await asyncio.get_running_loop().run_in_executor(None, extract_calls, mode, text)


def render_calls(calls: list[ToolCall], stream: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        item = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": i, **item} if stream else item)
    return out
