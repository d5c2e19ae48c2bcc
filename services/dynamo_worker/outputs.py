"""The scheduler's TokenDeltas (and RequestErrors) as Dynamo's LLMEngineOutput dicts:
token_ids (the delta's), index (the choice), finish_reason on a choice's last one, with
completion_usage (prompt, completion and total tokens, cached prompt tokens) and, when
asked, log_probs. Dynamo's backend detokenizes them.

Finish reasons: ours "stop" (EOS or a stop token) and "length" are Dynamo's too; "abort"
is Dynamo's "cancelled"; an error is "error: <message>", as Dynamo's own backends send one.
"""

from __future__ import annotations

from typing import Any

from shared.messages import RequestError, TokenDelta

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}


class ChoiceCounts:
    """Output tokens per choice so far, and the prompt tokens found cached (told on a
    choice's first delta only): usage is cumulative, the deltas are not."""

    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}
        self.cached = 0

    def add(self, delta: TokenDelta) -> None:
        if delta.seq_index not in self.tokens:
            self.cached = max(self.cached, delta.num_cached_tokens)
        self.tokens[delta.seq_index] = self.tokens.get(delta.seq_index, 0) + len(delta.token_ids)


def engine_output(delta: TokenDelta, counts: ChoiceCounts) -> dict[str, Any]:
    counts.add(delta)
    out: dict[str, Any] = {"token_ids": list(delta.token_ids), "index": delta.seq_index}
    if delta.logprobs:
        out["log_probs"] = [lp.logprob for lp in delta.logprobs]
    if delta.finish_reason is not None:
        out["finish_reason"] = FINISH_REASONS.get(delta.finish_reason, delta.finish_reason)
        out["completion_usage"] = usage(delta.num_prompt_tokens, sum(counts.tokens.values()), counts.cached)
    return out


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_output(err: RequestError | str) -> dict[str, Any]:
    message = err.message if isinstance(err, RequestError) else err
    return {"token_ids": [], "index": 0, "finish_reason": f"error: {message}"}
