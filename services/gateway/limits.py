"""The bounds on the work one request may ask for, decided at the gateway.

Each bound is a field of RequestLimits and a flag of `pagedserve serve` and of the gateway
stage (`--max-n`, `--max-logprobs`, ...), built from the fields below (shared.options), so
that the launcher forwards them whole with the gateway's other options. The defaults sit above what OpenAI allows (n <= 128
is OpenAI's, but 16 samples are more than any sampling client asks; top_logprobs <= 20;
stop <= 4; logit_bias <= 300 entries; 128 tools; a schema 10 levels deep) and above what
vLLM's own clients send, so honest clients never meet them; a request past one gets a 400
naming the field (`param`) and the bound (services/gateway/openai).

Kept free of aiohttp: the launcher, imported by every `pagedserve` command, reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.options import option, positive


def _limit(default: int, help_: str):
    return option(default, f"{help_} (default {default}; 400 beyond)", parse=positive)


@dataclass(frozen=True)
class RequestLimits:
    """bounds on one request's work (the gateway)"""

    max_n: int = _limit(16, "samples (n) or beams (beam_width) of one request; the engine allows at most 64")
    max_prompts: int = _limit(64, "prompts in one /v1/completions batch")
    max_embedding_inputs: int = _limit(2048, "inputs in one /v1/embeddings request (OpenAI's bound)")
    max_sequences: int = _limit(256, "sequences one request starts: prompts x n (x beam_width with beam search)")
    max_logprobs: int = _limit(20, "top candidates per position (logprobs, top_logprobs, prompt_logprobs), "
                                   "as OpenAI and vLLM; the engine allows at most 64")
    max_prompt_logprobs: int = _limit(2**20, "prompt logprob entries one request may return: prompts x n x prompt "
                                             "length x (candidates + 1), a text prompt's length counted in "
                                             "characters (echo with logprobs, prompt_logprobs)")
    max_stop: int = _limit(16, "stop strings")
    max_stop_chars: int = _limit(256, "characters of each stop string")
    max_stop_token_ids: int = _limit(64, "stop_token_ids")
    max_bad_words: int = _limit(64, "bad_words")
    max_bad_words_chars: int = _limit(4096, "characters of all bad_words together")
    max_logit_bias: int = _limit(1024, "logit_bias entries")
    max_allowed_token_ids: int = _limit(65536, "allowed_token_ids")
    max_schema_chars: int = _limit(131072, "characters of a JSON schema constraint (response_format, "
                                           "structured_outputs.json, guided_json, json_schema, a required or named "
                                           "tool_choice's) and of each tool's parameters")
    max_schema_depth: int = _limit(64, "nesting depth (objects and arrays) of a JSON schema or tool parameters")
    max_grammar_chars: int = _limit(65536, "characters of a regex, a grammar or a choice list constraint")
    max_tools: int = _limit(128, "tools of one chat request")


DEFAULT_LIMITS = RequestLimits()


def nesting_depth(value, stop_after: int) -> int:
    """The depth of nested objects and arrays in a parsed JSON value (a scalar 0, `{}` 1), without
    recursion; it stops counting once past stop_after."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            break
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


class LimitExceeded(ValueError):
    """A value past one of the bounds; the message says which, to follow the field's name."""


def schema_json(schema: dict, limits: RequestLimits) -> str:
    """A JSON schema's text, held to the schema bounds (depth first: json.dumps recurses)."""
    if nesting_depth(schema, limits.max_schema_depth) > limits.max_schema_depth:
        raise LimitExceeded(f"is nested more than {limits.max_schema_depth} levels deep")
    text = json.dumps(schema)
    if len(text) > limits.max_schema_chars:
        raise LimitExceeded(f"is longer than {limits.max_schema_chars} characters")
    return text
