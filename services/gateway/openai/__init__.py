"""The OpenAI dialect of the gateway: request bodies in, response bodies out.

- fields: every request field of every endpoint, declared once with its type and bounds;
- request, completions, chat, tokenize_bodies: the bodies parsed (ParsedRequest, the
  tokenizer stage's requests), through readers, sampling and structured;
- field_policy: what happens to the fields an endpoint does not read;
- errors: ApiError, the OpenAI-style error body;
- responses: whole answers and streamed chunks; logprobs: their shapes; tools: tool calling;
- openapi: /openapi.json, from the same declarations.
"""
