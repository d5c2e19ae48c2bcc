"""The OpenAI dialect of the gateway: request bodies in (validated, as SamplingParams and a
prompt or chat messages), response bodies out.

Built: /v1/completions (text or token-id prompts, batches, echo, logprobs) and
/v1/chat/completions (text parts, tools and tool_choice, logprobs), with sampling (n, beam
search, penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, seeds), stop strings
and token ids, structured output (response_format, structured_outputs, guided_*, json_schema),
prompt_logprobs and cache_salt; vLLM's /tokenize and /detokenize. Parsing is strict about what
it reads (types, ranges, the model name; the work a request asks for is held to the gateway's
RequestLimits) and lenient about the rest (field_policy): a field that would change the answer
and is not built is refused, harmless ones are accepted. Every rejection is an ApiError
rendering as an OpenAI-style error body that names the field (`param`).

- fields: every request field of every endpoint, declared once with its type and bounds;
  the parsers' ranges, the field policy and /openapi.json (openapi) derive from it;
- request, completions, chat, tokenize_bodies: the bodies parsed, through readers (one typed
  field), sampling (SamplingParams and the work asked for) and structured (output constraints);
- errors: ApiError; responses: whole answers and streamed chunks; logprobs: their shapes;
  tools: tool definitions in, tool calls parsed out of the answer.
"""
