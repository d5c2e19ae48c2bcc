"""The Anthropic dialect of the gateway: POST /v1/messages and /v1/messages/count_tokens.

A Messages body is translated into the OpenAI chat body the chat path parses (translate), so the
chat template, tool calls (services/gateway/openai/tools.py), stop strings, sampling, limits and
the field policy are the chat path's own; the answer is then shaped as Anthropic's message or its
stream of typed events (message), and errors as Anthropic's error body (errors).

- translate: system, content blocks (text, tool_use, tool_result), tools and tool_choice,
  stop_sequences, max_tokens (required) -> a ParsedRequest, with the fields the
  Messages API takes over or does not build refused by name;
- message: whole messages and the SSE events of a streamed one, from the TextDeltas;
- routes: the aiohttp handlers; errors: Anthropic's error shape; openapi: the routes' description.
"""
