"""The sampling fields of both generation endpoints, as one SamplingParams; and the work a
request asks for (sequences, prompt logprobs) held to the gateway's RequestLimits."""

from __future__ import annotations

import msgspec

from services.gateway.limits import RequestLimits
from services.gateway.openai.errors import ApiError, wrong_type
from services.gateway.openai.fields import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, bounds
from services.gateway.openai.readers import boolean, integer, number, string_list, token_id_list
from services.gateway.openai.structured import output_constraint
from shared.messages import SamplingParams


def read_max_tokens(body: dict, name: str, default: int | None) -> int | None:
    if body.get(name) is None and name == "max_tokens" and body.get("n_predict") is not None:
        value = integer(body, "n_predict", None)  # llama.cpp's name; -1 means no limit
        if value == -1:
            return None
        name = "n_predict"
    else:
        value = integer(body, name, default)
    if value is not None and value < 1:
        raise ApiError(f"'{name}' must be at least 1, got {value}.", param=name)
    return value


def _sampling(body: dict, max_tokens: int, limits: RequestLimits) -> SamplingParams:
    temperature = number(body, "temperature", 1.0, *bounds("temperature"))
    top_p, (low, high) = number(body, "top_p", 1.0), bounds("top_p")
    if not low < top_p <= high:
        raise ApiError(f"'top_p' must be in ({low}, {high}], got {top_p}.", param="top_p")
    top_k = integer(body, "top_k", 0)
    if top_k < bounds("top_k")[0]:
        raise ApiError(f"'top_k' must be -1 or 0 (no cut) or positive, got {top_k}.", param="top_k")
    n = integer(body, "n", 1)
    beam = boolean(body, "use_beam_search", False)
    beam_width = integer(body, "beam_width", max(n, 4) if beam else 4)
    if beam and not n <= beam_width <= bounds("beam_width", limits)[1]:
        raise ApiError(f"'beam_width' must be between n ({n}) and {limits.max_n}, got {beam_width}.",
                       param="beam_width")
    return SamplingParams(
        n=n,
        use_beam_search=beam,
        beam_width=beam_width,
        length_penalty=number(body, "length_penalty", 1.0, *bounds("length_penalty")),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=integer(body, "seed", None),
        stop=_stop(body, limits),
        stop_token_ids=token_id_list(body, "stop_token_ids", limits.max_stop_token_ids),
        ignore_eos=boolean(body, "ignore_eos", False),
        include_stop_str_in_output=boolean(body, "include_stop_str_in_output", False),
        min_p=number(body, "min_p", 0.0, *bounds("min_p")),
        presence_penalty=number(body, "presence_penalty", 0.0, *bounds("presence_penalty")),
        frequency_penalty=number(body, "frequency_penalty", 0.0, *bounds("frequency_penalty")),
        repetition_penalty=_repetition_penalty(body),
        logit_bias=_logit_bias(body, limits),
        min_tokens=_min_tokens(body, max_tokens),
        allowed_token_ids=token_id_list(body, "allowed_token_ids", limits.max_allowed_token_ids, allow_empty=False),
        bad_words=_bad_words(body, limits),
        cache_salt=_cache_salt(body),
        speculative=boolean(body, "speculative", True),
    )


def _cache_salt(body: dict) -> str | None:
    """vLLM's cache_salt: requests with different salts never share cached KV blocks."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters.",
                       param="cache_salt")
    return salt


def _bad_words(body: dict, limits: RequestLimits) -> list[str]:
    words = string_list(body, "bad_words", "an array of non-empty strings", blank=False)
    if len(words) > limits.max_bad_words or sum(map(len, words)) > limits.max_bad_words_chars:
        raise ApiError(f"At most {limits.max_bad_words} bad_words of {limits.max_bad_words_chars} characters "
                       f"together.", param="bad_words")
    return words


def _repetition_penalty(body: dict) -> float:
    value = number(body, "repetition_penalty", 1.0, *bounds("repetition_penalty"))
    if value <= 0:
        raise ApiError("'repetition_penalty' must be above 0 (1 = none).", param="repetition_penalty")
    return value


def _logit_bias(body: dict, limits: RequestLimits) -> list[tuple[int, float]]:
    """OpenAI's {"token id": bias}; the ids are checked against the vocabulary by the tokenizer stage."""
    bias = body.get("logit_bias")
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to numbers", bias)
    if len(bias) > limits.max_logit_bias:
        raise ApiError(f"'logit_bias' has more than {limits.max_logit_bias} entries.", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise ApiError(f"'logit_bias' keys must be token ids, got {key[:20]!r}.", param="logit_bias")
        out.append((int(key), number({"logit_bias": value}, "logit_bias", 0.0, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
    return sorted(out)


def _min_tokens(body: dict, max_tokens: int | None) -> int:
    value = integer(body, "min_tokens", 0)
    if value < 0 or (max_tokens is not None and value > max_tokens):
        raise ApiError(f"'min_tokens' must be between 0 and max_tokens, got {value}.", param="min_tokens")
    return value


def logprob_count(body: dict, name: str, limits: RequestLimits) -> int | None:
    value = integer(body, name, None)
    low, high = bounds(name, limits)
    if value is not None and not low <= value <= high:
        raise ApiError(f"'{name}' must be between {low} and {high}, got {value}.", param=name)
    return value


def generation_params(body: dict, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                      echo: bool, limits: RequestLimits) -> SamplingParams:
    """The request's SamplingParams: its sampling fields, then logprobs and the output constraint
    (neither with beam search; no constraint with ignore_eos)."""
    params = _sampling(body, max_tokens, limits)
    if params.use_beam_search and (logprobs is not None or prompt_logprobs is not None):
        name = "logprobs" if logprobs is not None else "prompt_logprobs"
        raise ApiError(f"'{name}' cannot be combined with beam search.", param=name)
    structured = output_constraint(body, limits)
    if structured is not None and (params.use_beam_search or params.ignore_eos):
        name = "use_beam_search" if params.use_beam_search else "ignore_eos"
        raise ApiError(f"'{name}' cannot be combined with structured output.", param=name)
    return msgspec.structs.replace(
        params, logprobs=logprobs, prompt_logprobs=prompt_logprobs, echo=echo, structured=structured,
        skip_special_tokens=boolean(body, "skip_special_tokens", True),
        spaces_between_special_tokens=boolean(body, "spaces_between_special_tokens", True))


def _stop(body: dict, limits: RequestLimits) -> list[str]:
    stop = string_list(body, "stop", "a string or an array of strings")
    if len(stop) > limits.max_stop:
        raise ApiError(f"Too many stop strings: {len(stop)}, at most {limits.max_stop}.", param="stop")
    for s in stop:
        if not s or len(s) > limits.max_stop_chars:
            raise ApiError(f"Each stop string must have 1 to {limits.max_stop_chars} characters.", param="stop")
    return stop


def check_work(params: SamplingParams, prompt_lengths: list[int], limits: RequestLimits, logprobs_param: str) -> None:
    """The sequences a request starts, and the prompt logprobs it returns (a text prompt's
    length counted in characters, an upper bound of its tokens for common tokenizers)."""
    per_prompt = params.beam_width if params.use_beam_search else params.n
    sequences = len(prompt_lengths) * per_prompt
    if sequences > limits.max_sequences:
        each = "beam_width" if params.use_beam_search else "n"
        raise ApiError(f"This request would start {sequences} sequences (prompts x {each}); at most "
                       f"{limits.max_sequences}.", param=each)
    if params.prompt_logprobs is not None:
        entries = sum(prompt_lengths) * params.n * (params.prompt_logprobs + 1)
        if entries > limits.max_prompt_logprobs:
            raise ApiError(f"This request would return about {entries} prompt logprob entries (prompts x n x prompt "
                           f"length x (candidates + 1)); at most {limits.max_prompt_logprobs}: send fewer or shorter "
                           f"prompts, or fewer candidates.", param=logprobs_param)
