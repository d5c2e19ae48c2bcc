"""The one policy for request fields an endpoint does not read itself.

A field the endpoint reads (declared for it in fields.py) is validated by its parser. Of the rest:
- fields known to be harmless (they do not change the answer: `user`, `metadata`,
  `store`, ...) are accepted silently;
- fields that would change the answer and are not implemented are refused with a 400
  naming them, unless they hold a value that means "not used" (null, false, an empty
  list or object, or their documented neutral value): those below, and those another
  endpoint reads that are declared refused elsewhere (`tools` on /v1/completions, `echo` on chat);
- any other field is accepted and logged once per field name per process, so an
  operator sees what clients send without the log filling up.
No field that changes the answer is ever silently ignored.
"""

from __future__ import annotations

import logging

from services.gateway.openai.fields import GENERATION, ignored_elsewhere, known_fields, refused_elsewhere

log = logging.getLogger(__name__)

# Accepted and ignored: bookkeeping, routing and hints that leave the tokens unchanged.
HARMLESS = frozenset({
    "metadata", "store", "service_tier", "request_id", "prompt_cache_key",
    "safety_identifier", "cache_prompt", "modalities", "mm_processor_kwargs",
    "kv_transfer_params", "vllm_xargs", "id_slot", "slot_id", "t_max_predict_ms",
})

# Not implemented, and they would change the answer: refused unless "not used".
# name -> values that mean "not used" (besides null / false / empty containers).
UNSUPPORTED: dict[str, tuple] = {
    "suffix": ("",),
    "best_of": (1,),
    "functions": (),
    "function_call": ("none", "auto"),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "grammar": (),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "documents": (),
    "chat_template": (),
    "return_tokens_as_token_ids": (),
    "prompt_embeds": (),
    "reasoning_effort": (),
    "typical_p": (1, 1.0),
    "top_n_sigma": (-1, -1.0),
    "mirostat": (0,),
    "repeat_penalty": (1, 1.0),
    "repeat_last_n": (),
    "penalize_nl": (),
    "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "tfs_z": (1, 1.0),
    "dynatemp_range": (0, 0.0),
    "n_probs": (0,),
    "samplers": (),
    "n_keep": (),
    "logit_bias_type": (),
}
MAX_LOGGED_NAMES = 256  # a client inventing names cannot grow the set without bound

_logged: set[str] = set()


def is_unused(value, neutral: tuple) -> bool:
    """null, false, an empty list/object/string, or one of the field's neutral values.
    Compared by type too, so 0 does not pass for false nor 1 for true; a numeric field is
    unused only at its neutral number."""
    if value is None:
        return True
    if any(type(n) in (int, float) for n in neutral):
        return type(value) in (int, float) and any(value == n for n in neutral)
    if value is False or (isinstance(value, (list, dict, str)) and not value):
        return True
    return any(type(value) is type(n) and value == n for n in neutral)


# endpoint -> (the fields it reads, those it refuses unless unused, those it ignores)
_POLICY = {e: (known_fields(e), {**UNSUPPORTED, **refused_elsewhere(e)}, HARMLESS | ignored_elsewhere(e))
           for e in GENERATION}


def unsupported_field(body: dict, endpoint: str) -> str | None:
    """The first field of body that would change the answer and is not implemented on this
    endpoint; logs (once per name) the fields nobody knows."""
    known, unsupported, harmless = _POLICY[endpoint]
    for name, value in body.items():
        if name in known or name in harmless:
            continue
        if name in unsupported:
            if not is_unused(value, unsupported[name]):
                return name
        elif name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            log.warning("ignoring request field %r: pagedserve does not know it", name[:64])
    return None
