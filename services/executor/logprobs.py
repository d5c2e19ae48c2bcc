"""Log-probabilities a step returns: of sampled tokens (`logprobs`) and of scored prompt tokens.

Values are the log-softmax of the model's raw float32 logits at that position: before
the logits processors, temperature and cuts (vLLM's default `logprobs_mode`,
"raw_logprobs"), so they score the text under the model itself whatever the sampling
settings. Each token comes with its rank in the vocabulary (1 = most likely) and the
`k` most likely tokens of the position, best first. One log_softmax and one top-k for
all the rows of a kind; only the per-row lists are built in Python.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.messages import TokenLogprob


def token_logprobs(logits: Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits [rows, vocab]; tokens[i] is the token whose logprob row i gives, with ks[i] top ones."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(tokens, device=logits.device)[:, None]
    values = logprobs.gather(1, chosen)
    ranks = (logprobs > values).sum(dim=-1) + 1
    k = max(ks)
    top_values, top_tokens = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], chosen[:, :0])
    values, ranks = values[:, 0].tolist(), ranks.tolist()
    top_values, top_tokens = top_values.tolist(), top_tokens.tolist()
    return [
        TokenLogprob(token, values[i], ranks[i],
                     [TokenLogprob(t, v, r + 1) for r, (t, v) in enumerate(zip(top_tokens[i][: ks[i]],
                                                                              top_values[i][: ks[i]], strict=True))])
        for i, token in enumerate(tokens)
    ]
