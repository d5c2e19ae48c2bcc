"""Dynamo's PreprocessedRequest (a dict: token_ids, stop_conditions, sampling_options,
output_options, eos_token_ids, ...) to the scheduler's TokenizedRequest.

Dynamo's frontend tokenized the prompt and applied the chat template; its backend
detokenizes and finds stop strings itself (it then stops the stream, and the handler
aborts the request), so only token-level conditions reach the engine: max_tokens (unset:
the rest of the context), min_tokens, ignore_eos, the hidden stop token ids and the
model's EOS ids. What the engine cannot honour here (a guided-decoding grammar, which the
tokenizer stage would compile) is refused with UnsupportedRequest, a 400.
"""

from __future__ import annotations

import time
from typing import Any

from shared.messages import SamplingParams, TokenizedRequest


class UnsupportedRequest(ValueError):
    """The request asks for something this worker does not do (a 400)."""


# sampling_options fields taken as they are (None: our default)
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "length_penalty")


def _get(d: dict[str, Any] | None, key: str) -> Any:
    return None if d is None else d.get(key)


def sampling_params(request: dict[str, Any], max_model_len: int) -> SamplingParams:
    prompt = request.get("token_ids") or []
    stop = request.get("stop_conditions") or {}
    sampling = request.get("sampling_options") or {}
    output = request.get("output_options") or {}
    if sampling.get("guided_decoding"):
        raise UnsupportedRequest("guided decoding (response_format, structured outputs) is not supported by the "
                                 "pagedserve Dynamo worker; use pagedserve's own gateway for it")
    if sampling.get("use_beam_search"):
        raise UnsupportedRequest("beam search is not supported through Dynamo (its stream carries one answer per "
                                 "choice as it is generated)")
    room = max_model_len - len(prompt)
    if room < 1:
        raise UnsupportedRequest(f"the prompt has {len(prompt)} tokens; the context holds {max_model_len}")
    max_tokens = stop.get("max_tokens")
    values: dict[str, Any] = {k: sampling[k] for k in _SAMPLING if sampling.get(k) is not None}
    if values.get("top_k") == -1:
        values["top_k"] = 0
    logprobs = output.get("logprobs")
    return SamplingParams(
        **values,
        max_tokens=room if max_tokens is None else min(int(max_tokens), room),
        min_tokens=int(stop.get("min_tokens") or 0),
        ignore_eos=bool(stop.get("ignore_eos") or False),
        stop_token_ids=list(stop.get("stop_token_ids_hidden") or []),
        logprobs=None if logprobs is None else int(logprobs),
    )


def tokenized_request(request_id: str, request: dict[str, Any], max_model_len: int,
                      default_eos: list[int]) -> TokenizedRequest:
    """The scheduler's request for Dynamo's; raises UnsupportedRequest."""
    prompt = request.get("token_ids")
    if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
        raise UnsupportedRequest("token_ids: a non-empty list of token ids is required")
    eos = request.get("eos_token_ids")
    return TokenizedRequest(
        request_id=request_id, prompt_token_ids=list(prompt), params=sampling_params(request, max_model_len),
        eos_token_ids=list(default_eos if eos is None else eos), arrival_time=time.time())
