"""The request fields of the OpenAI endpoints, with their bounds."""

from __future__ import annotations

from services.gateway.limits import DEFAULT_LIMITS

# The default bounds (services/gateway/limits.py: each a flag of the gateway)
MAX_STOP_STRINGS = DEFAULT_LIMITS.max_stop
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
