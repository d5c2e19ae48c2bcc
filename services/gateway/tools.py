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
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shared.messages import StructuredOutput, ToolCall

MAX_TOOLS = 128
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def parse_tools(body: dict) -> tuple[list[dict], ToolMode | None, StructuredOutput | None]:
    """(tool definitions for the template, the mode, the output constraint); ToolError if bad."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'.", "tool_choice")
        return [], None, None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be an array of at most {MAX_TOOLS} tools.", "tools")
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
        return defs, ToolMode("required", names), StructuredOutput("json_schema", json.dumps(array))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in schemas:
        raise ToolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": <one of the tools>}}.", "tool_choice")
    return defs, ToolMode("named", names, name), StructuredOutput("json_schema", json.dumps(schemas[name]))


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def extract_calls(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer."""
    if mode.choice == "named":
        return None, [ToolCall(_new_id(), mode.named, text)]
    if mode.choice == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []  # cut short by max_tokens: the text as it is
        return None, [ToolCall(_new_id(), c["name"], _arguments(c["arguments"])) for c in calls]
    if mode.choice == "none":
        return text, []
    calls = []
    for block in _CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in mode.tools:
            calls.append(ToolCall(_new_id(), call["name"], _arguments(call.get("arguments", {}))))
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


def render_calls(calls: list[ToolCall], stream: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        item = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        out.append({"index": i, **item} if stream else item)
    return out
