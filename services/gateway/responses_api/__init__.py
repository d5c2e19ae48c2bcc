"""OpenAI's Responses API on the gateway: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`.

A Responses request is translated into the request the chat path builds (so sampling, tools,
structured output, the field policy and the limits are the chat path's), and its answer is
shaped as Responses output items.

- fields: which body fields are read, passed on, harmless or refused;
- items: input items as chat messages, and output items as the assistant turn that continues them;
- request: the body, translated and parsed by the chat path (services/gateway/openai/chat.py);
- output: the response object and its items; events: the typed stream events; sse: writing them;
- store: the bounded, expiring in-memory store behind GET and previous_response_id;
- routes: the HTTP handlers, registered by services/gateway/app.py.
"""
