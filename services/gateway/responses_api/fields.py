"""The fields of a `POST /v1/responses` body, and the field policy they are held to.

A Responses body is translated into the chat body the chat path reads (request.py), so most
checks are the chat path's own. This table decides the rest, as the chat endpoint's policy
does (services/gateway/openai/field_policy.py): a field read here is translated; a harmless
one (bookkeeping: metadata, user, ...) is accepted; a field that would change the answer and
is not built (background, include, truncation "auto", top_logprobs, conversation, prompt
templates, and the chat-only fields such as messages or response_format) is a 400 unless it
holds a value meaning "not used"; any other field is logged once and ignored. `reasoning` is
read, and held to its own rules (request.py: no effort, summaries accepted but not made).
"""

from __future__ import annotations

import logging

from services.gateway.openai.field_policy import HARMLESS, MAX_LOGGED_NAMES, UNSUPPORTED, is_unused
from services.gateway.openai.fields import CHAT, known_fields

log = logging.getLogger(__name__)

# Translated into the chat body under another name, or read here.
READ = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
    "temperature", "top_p", "stream", "store", "previous_response_id", "metadata", "reasoning",
})
# vLLM's sampling extras, passed to the chat path as they are.
PASSED = frozenset({
    "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
    "stop_token_ids", "logit_bias", "min_tokens", "bad_words", "cache_salt", "skip_special_tokens",
    "chat_template_kwargs", "priority",
})
# Responses fields that would change the answer and are not built: refused unless these values.
NOT_BUILT: dict[str, tuple] = {
    "background": (), "conversation": (), "prompt": (), "include": (), "max_tool_calls": (),
    "top_logprobs": (0,), "truncation": ("disabled",), "context_management": (),
}
_HARMLESS = HARMLESS | {"user", "stream_options", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
_REFUSED = {**UNSUPPORTED, **{f: () for f in known_fields(CHAT) - READ - PASSED - _HARMLESS}}
_REFUSED.update({"n": (1,), **NOT_BUILT})

_logged: set[str] = set()


def refused_field(body: dict) -> str | None:
    """The first field of body that would change the answer and is not built here."""
    for name, value in body.items():
        if name in READ or name in PASSED or name in _HARMLESS:
            continue
        if name in _REFUSED:
            if not _unused(value, _REFUSED[name]):
                return name
        elif name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            log.warning("ignoring /v1/responses field %r: pagedserve does not know it", name[:64])
    return None


def _unused(value, neutral: tuple) -> bool:
    """is_unused, and an object whose every value is null (`reasoning: {"effort": null}`)."""
    if isinstance(value, dict) and value and all(v is None for v in value.values()):
        return True
    return is_unused(value, neutral)
