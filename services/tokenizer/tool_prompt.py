"""Chat messages (with tools, tool calls and tool results) as a chat template wants them.

A template that knows tools (it mentions `tools`) gets them as `tools=` and the
assistant calls as `tool_calls` with their arguments as objects, as transformers'
templates expect. A template that does not (SmolLM2's, plain ChatML) gets the Hermes
convention written into the messages themselves: the tools described in the system
message, each call as `<tool_call>{"name", "arguments"}</tool_call>` in the assistant's
text, each result as `<tool_response>` in a tool message. The gateway parses the same
`<tool_call>` syntax back out of the answer (services/gateway/openai/tools.py).
"""

from __future__ import annotations

import json

from shared.messages import ChatMessage

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>{tools}</tools> For each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>"
)


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def conversation(messages: list[ChatMessage], tools: list[dict], native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages as dicts, tools for the template's `tools=` or None)."""
    if native:
        out = []
        for m in messages:
            d = {"role": m.role, "content": m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out, (tools or None)
    out = []
    for m in messages:
        content = m.content
        if m.tool_calls:
            calls = "\n".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': _arguments(c.arguments)})}"
                              f"\n</tool_call>" for c in m.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        if m.role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m.role, "content": content})
    if tools:
        system = HERMES_SYSTEM.format(tools=json.dumps(tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None
