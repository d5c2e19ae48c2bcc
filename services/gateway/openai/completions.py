"""/v1/completions bodies: one prompt or a batch (text or token ids), echo (with max_tokens 0:
the prompt alone, scored), logprobs as a count, as a ParsedRequest."""

from __future__ import annotations

from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.openai.errors import ApiError, wrong_type
from services.gateway.openai.fields import COMPLETION, DEFAULT_COMPLETION_MAX_TOKENS
from services.gateway.openai.readers import boolean, integer, is_token_id
from services.gateway.openai.request import ParsedRequest, check_common, stream_flags
from services.gateway.openai.sampling import check_work, generation_params, logprob_count, read_max_tokens


def parse_completion(body: dict, model_names: set[str], limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    check_common(body, model_names, COMPLETION, limits)
    prompts = _prompts(body, limits)
    (prompt, prompt_ids), batch = prompts[0], (prompts if len(prompts) > 1 else None)
    echo = boolean(body, "echo", False)
    echo_only = echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    # echo_only: the engine still runs one step (its token is dropped) to score the prompt
    max_tokens = 1 if echo_only else read_max_tokens(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
    stream, include_usage = stream_flags(body)
    logprobs = logprob_count(body, "logprobs", limits)
    prompt_logprobs = logprob_count(body, "prompt_logprobs", limits)
    if echo and logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    params = generation_params(body, max_tokens, logprobs, prompt_logprobs, echo, limits)
    check_work(params, [len(text if ids is None else ids) for text, ids in prompts], limits,
                "logprobs" if echo and logprobs is not None else "prompt_logprobs")
    return ParsedRequest(
        "completion", params, stream, include_usage, boolean(body, "return_token_ids", False),
        prompt=prompt, prompt_token_ids=prompt_ids, echo_only=echo_only, batch=batch,
        add_special_tokens=boolean(body, "add_special_tokens", None), priority=integer(body, "priority", 0),
    )


def _prompts(body: dict, limits: RequestLimits) -> list[tuple[str | None, list[int] | None]]:
    """Each prompt as (text, None) or (None, token ids): one prompt, or a batch of them."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required.", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise ApiError(f"Too many prompts in a batch: {len(prompt)}, at most {limits.max_prompts}.",
                           param="prompt")
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt(prompt, "prompt")]


def _prompt(prompt, where: str) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(f"'{where}' must not be empty.", param="prompt")
        return prompt, None
    if not isinstance(prompt, list):
        raise wrong_type("prompt", "a string, an array of token ids, or an array of those", prompt)
    if not prompt:
        raise ApiError(f"'{where}' must not be empty.", param="prompt")
    if all(is_token_id(t) for t in prompt):
        return None, prompt
    raise ApiError(f"'{where}' token ids must be non-negative integers.", param="prompt")
