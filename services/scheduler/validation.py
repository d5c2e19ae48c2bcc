"""What the scheduler accepts from a gateway: every number in a range its arithmetic survives.

The gateway validates requests for the API; this is the scheduler's own guard, so a
peer that skips the gateway (or a bug in it) cannot hand the scheduler a request
that breaks its loop. The ranges are wider than the gateway's: they bound what the
arithmetic survives, not what is useful.

It also refuses the combinations of constraints that can leave a step with no token
to sample (`constraints_problem`), each a 400 naming the fields:
- structured output with `allowed_token_ids`: the grammar may need a token the list
  leaves out;
- structured output with `min_tokens` > 0, or with `ignore_eos`: a finished grammar
  allows only EOS, which `min_tokens` masks and `ignore_eos` steps past (vLLM instead
  lets the grammar's EOS through under min_tokens; refusing is the rule that never
  changes what a request asked for);
- `allowed_token_ids` all masked by `min_tokens` > 0 (every one an EOS or stop token
  id), or all one-token `bad_words`, or outside the vocabulary.
A resumed request (its output so far given, `resume_problem`) must be one plain sequence
(n == 1, no beam search) whose output is token ids, shorter than max_tokens and, with
the prompt, shorter than the context: else a 400 naming what is wrong.
What admission cannot see (a grammar whose every path needs a bad word, say) fails at
run time, that request alone, with a 400 from the executor (`StepResult.failed`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shared.messages import POOLING_KINDS, SamplingParams

MAX_BEAM_WIDTH = 64
MAX_N = 64
MAX_TEMPERATURE = 1e4
MAX_LENGTH_PENALTY = 100.0  # beam scores divide by length ** length_penalty
MAX_SEED = 2**63 - 1 - MAX_N  # each sample adds its index to the seed, which must stay an int64
MAX_TOKEN_ID = 2**31 - 1
MAX_PENALTY = 1e4  # penalties and biases: finite and far from overflowing a float32 logit
MAX_LOGPROBS = 64


def _float_problem(name: str, value: float, low: float, high: float) -> str | None:
    if not math.isfinite(value) or not low <= value <= high:
        return f"{name} must be a finite number between {low:g} and {high:g}, got {value!r}"
    return None


def params_problem(p: SamplingParams) -> str | None:
    """Why these sampling parameters cannot be run, or None."""
    problem = (
        _float_problem("temperature", p.temperature, 0.0, MAX_TEMPERATURE)
        or _float_problem("top_p", p.top_p, 0.0, 1.0)
        or _float_problem("length_penalty", p.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        or _float_problem("min_p", p.min_p, 0.0, 1.0)
        or _float_problem("presence_penalty", p.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        or _float_problem("frequency_penalty", p.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        or _float_problem("repetition_penalty", p.repetition_penalty, 1e-6, MAX_PENALTY)
        or next(filter(None, (_float_problem("logit_bias", b, -MAX_PENALTY, MAX_PENALTY) for _, b in p.logit_bias)),
                None)
    )
    if problem:
        return problem
    if p.top_p <= 0:
        return "top_p must be above 0"
    if p.max_tokens is None or p.max_tokens < 1:
        return f"max_tokens must be at least 1, got {p.max_tokens}"
    if p.top_k < -1:
        return f"top_k must be -1, 0 or positive, got {p.top_k}"
    if not 1 <= p.n <= MAX_N:
        return f"n must be between 1 and {MAX_N}, got {p.n}"
    if p.use_beam_search and not p.n <= p.beam_width <= MAX_BEAM_WIDTH:
        return f"beam_width must be between n ({p.n}) and {MAX_BEAM_WIDTH}, got {p.beam_width}"
    if p.seed is not None and not -MAX_SEED <= p.seed <= MAX_SEED:
        return f"seed must be between {-MAX_SEED} and {MAX_SEED}, got {p.seed}"
    if any(not 0 <= t <= MAX_TOKEN_ID for t in p.stop_token_ids):
        return "stop_token_ids must be token ids"
    if any(not 0 <= t <= MAX_TOKEN_ID for t in (*p.allowed_token_ids, *(t for t, _ in p.logit_bias),
                                                 *(t for word in p.bad_words_ids for t in word))):
        return "allowed_token_ids, logit_bias and bad_words_ids must name token ids"
    if not 0 <= p.min_tokens <= p.max_tokens:
        return f"min_tokens must be between 0 and max_tokens, got {p.min_tokens}"
    if p.use_beam_search and (p.logprobs is not None or p.prompt_logprobs is not None or p.structured is not None):
        return "beam search cannot be combined with logprobs, prompt_logprobs or structured output"
    for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return f"{name} must be between 0 and {MAX_LOGPROBS}, got {k}"
    if p.pooling is not None:
        if p.pooling not in POOLING_KINDS:
            return f"pooling must be one of {', '.join(POOLING_KINDS)}, got {p.pooling!r}"
        if p.n != 1 or p.use_beam_search or p.prompt_logprobs is not None:
            return "an embedding request (pooling) is one sequence, with no beam search or prompt_logprobs"
    return None


def constraints_problem(p: SamplingParams, eos_token_ids: Iterable[int] = (), vocab_size: int = 0) -> str | None:
    """Why these constraints can leave no token to sample, or None (see the module docstring)."""
    if p.structured is not None:
        clash = [name for name, on in (("allowed_token_ids", bool(p.allowed_token_ids)),
                                       ("min_tokens", p.min_tokens > 0), ("ignore_eos", p.ignore_eos)) if on]
        if clash:
            return (f"structured output (response_format / structured_outputs) cannot be combined with "
                    f"{' or '.join(clash)}: together they can leave no token to generate (a finished grammar "
                    "allows only the end-of-sequence token)")
    if not p.allowed_token_ids:
        return None
    top = token_limit(vocab_size)
    if any(not 0 <= t <= top for t in p.allowed_token_ids):
        return f"allowed_token_ids holds a token id outside the vocabulary (0 to {top})"
    left = set(p.allowed_token_ids)
    masked_by = []
    if p.min_tokens > 0:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if left & stops:
            masked_by.append("min_tokens (which masks the end-of-sequence and stop_token_ids)")
        left -= stops
    banned = {word[0] for word in p.bad_words_ids if len(word) == 1}
    if left & banned:
        masked_by.append("bad_words")
    left -= banned
    if not left:
        return f"every token of allowed_token_ids is masked by {' and '.join(masked_by)}: no token is left to generate"
    return None


def token_limit(vocab_size: int) -> int:
    """The largest token id of a vocabulary of vocab_size (0: not known yet)."""
    return vocab_size - 1 if vocab_size > 0 else MAX_TOKEN_ID


def request_problem(prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                    vocab_size: int = 0, eos_token_ids: Iterable[int] = ()) -> str | None:
    """Why a tokenized request cannot be run, or None."""
    if not prompt_token_ids:
        return "the prompt has no tokens"
    top = token_limit(vocab_size)
    if any(not 0 <= t <= top for t in prompt_token_ids):
        return f"the prompt holds a token id outside the vocabulary (0 to {top})"
    if not math.isfinite(arrival_time):
        return "arrival_time must be a finite number"
    return params_problem(params) or constraints_problem(params, eos_token_ids, vocab_size)


def resume_problem(prompt_len: int, output_token_ids: list[int], params: SamplingParams, max_model_len: int,
                   vocab_size: int = 0) -> str | None:
    """Why a request cannot resume after this output (its sequence's so far), or None."""
    if not output_token_ids:
        return None
    if params.n != 1 or params.use_beam_search:
        return "only a request of one sequence (n == 1, no beam search) can be resumed from its output"
    top = token_limit(vocab_size)
    if any(not 0 <= t <= top for t in output_token_ids):
        return f"the resumed output holds a token id outside the vocabulary (0 to {top})"
    if params.max_tokens is not None and len(output_token_ids) >= params.max_tokens:
        return (f"the resumed output ({len(output_token_ids)} tokens) leaves nothing to generate within "
                f"max_tokens ({params.max_tokens})")
    if prompt_len + len(output_token_ids) >= max_model_len:
        return (f"prompt ({prompt_len} tokens) plus the resumed output ({len(output_token_ids)} tokens) leaves "
                f"nothing to generate within the maximum context length of {max_model_len} tokens")
    return None
