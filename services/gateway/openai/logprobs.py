"""Logprobs in OpenAI's shapes (and vLLM's `prompt_logprobs`), from the tokenizer stage's entries.

- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, parallel lists;
  each `top_logprobs` item maps token text to logprob, holding the chosen token and the
  top `logprobs` candidates (as vLLM does); an echoed prompt's first token has null
  logprob and null top_logprobs; `text_offset` is each token's character offset in the
  choice's text.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}`, top_logprobs holding the top `top_logprobs` candidates.
- prompt_logprobs: `[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]`, one per
  prompt token, the actual token and the top candidates of its position.
Values are log-softmax of the model's raw logits (see services/executor/logprobs.py);
-inf (a token of zero probability) is written as -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

import math

from shared.messages import TokenLogprob

FLOOR = -9999.0


def clamp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR  # NaN cannot come from log-softmax; -inf can


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[dict, int]:
    """The logprobs object of these tokens (rank 0: an echoed prompt's first token, which has
    none), starting at text offset `offset`; returns it and the next offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        out["text_offset"].append(offset)
        out["tokens"].append(entry.token)
        offset += len(entry.token)
        if entry.rank == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(clamp(entry.logprob))
        top = {entry.token: clamp(entry.logprob)}
        for cand in entry.top:
            top.setdefault(cand.token, clamp(cand.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {"content": [
        {"token": e.token, "logprob": clamp(e.logprob), "bytes": list(e.bytes),
         "top_logprobs": [{"token": c.token, "logprob": clamp(c.logprob), "bytes": list(c.bytes)} for c in e.top]}
        for e in entries
    ], "refusal": None}


def prompt_logprobs(entries: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's list: null for the first prompt token (rank 0), then one dict per scored token."""
    out: list[dict | None] = []
    for e in entries:
        if e.rank == 0:
            out.append(None)
            continue
        ranked = {str(e.token_id): {"logprob": clamp(e.logprob), "rank": e.rank, "decoded_token": e.token}}
        for c in e.top:
            ranked.setdefault(str(c.token_id), {"logprob": clamp(c.logprob), "rank": c.rank,
                                                "decoded_token": c.token})
        out.append(ranked)
    return out
