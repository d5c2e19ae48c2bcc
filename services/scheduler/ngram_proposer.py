"""Prompt lookup ("ngram") proposals: the tokens that followed the latest earlier occurrence
of a sequence's last n tokens.

As vLLM's ngram proposer and llama.cpp's lookup decoding: n runs from `max_n` down to
`min_n`; the first n whose suffix occurs earlier in the prompt + output so far proposes up to
k tokens that followed its latest occurrence (one that ends before the suffix itself). No
match proposes nothing. With `per_match`, a match of n tokens proposes at most per_match x n:
replayed on SmolLM2's greedy outputs (`benchmarks.ngram_acceptance`) the first proposed token
after a 1-token match is right ~25% of the time and after a match of 4+ tokens ~80%, while each
verified token adds ~10-20% to a one-user step (`benchmarks.verify_cost`), so short matches
earn short proposals. The search is one vectorised comparison per n over the whole history
(numpy), about 0.1 ms for a history of a few thousand tokens on the 2-core host.
Pure: it reads a token list and returns a list.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int, per_match: int = 0) -> list[int]:
    """Up to k draft tokens for the sequence `tokens` (prompt + output so far), or []; with
    per_match > 0, at most per_match x the length of the matched suffix."""
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    history = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = history[-n:]
        # windows starting at 0 .. length - n - 1: every occurrence but the suffix itself
        windows = sliding_window_view(history[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + (min(k, per_match * n) if per_match > 0 else k)]
    return []
