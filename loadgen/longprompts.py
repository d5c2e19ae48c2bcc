"""Long prompts of real text: whole conversations joined until a drawn token length, then cut to it.

The long-prompt workload of benchmarks.serve_vs_peers (issue 26: a user pasting a document).
Each prompt's length is drawn uniformly in [low, high] tokens; conversations, in a seeded order
and each used at most once per stream, are appended (blank line between) until the text holds
that many tokens, and it is cut there. Decoding a token prefix and encoding it again can merge
or split tokens at the cut, so the cut is adjusted until the re-encoded count is right; a prompt
whose count still falls outside [low, high] is dropped. The stream ends when the texts run out.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from loadgen.datasets import Request
from loadgen.tokenizer import Tokenizer

SEPARATOR = "\n\n"


def parse_range(text: str) -> tuple[int, int]:
    """`LOW-HIGH` tokens (or a single length), 1 <= LOW <= HIGH."""
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError as err:
        raise ValueError(f"token range {text!r}: expected LOW-HIGH, e.g. 1536-2048") from err
    if not 1 <= lo <= hi:
        raise ValueError(f"token range {text!r}: need 1 <= LOW <= HIGH")
    return lo, hi


def fit_range(low: int, high: int, max_model_len: int, output_len: int, margin: int = 8) -> tuple[int, int]:
    """The range with its top lowered so that prompt + output fit the context, `margin` tokens spare
    for a BOS or template token a server may add."""
    top = max_model_len - output_len - margin
    if top < low:
        raise ValueError(f"prompts of {low}+ tokens and {output_len} output tokens do not fit a "
                         f"{max_model_len}-token context")
    return low, min(high, top)


def cut(tokenizer: Tokenizer, ids: list[int], n: int, tries: int = 4) -> tuple[str, int]:
    """Text of the first ~n of `ids` and its exact token count when encoded again."""
    want, text, count = n, "", 0
    for _ in range(tries):
        text = tokenizer.decode(ids[:want])
        count = len(tokenizer.encode(text))
        if count == n:
            break
        want = max(1, want + n - count)
    return text, count


def long_prompts(texts: Sequence[str], tokenizer: Tokenizer, rng: random.Random, low: int, high: int,
                 output_len: int) -> Iterator[Request]:
    """Requests with prompts of low..high tokens (see the module docstring)."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    source = (texts[i] for i in order if texts[i].strip())
    while True:
        n = rng.randint(low, high)
        ids: list[int] = []
        # A few tokens past n, so the re-encoded cut can grow if the decode/encode round trip shrank it.
        while len(ids) < n + 16:
            piece = next(source, None)
            if piece is None:
                return
            ids.extend(tokenizer.encode((SEPARATOR if ids else "") + piece))
        text, count = cut(tokenizer, ids, n)
        if low <= count <= high:
            yield Request(text, count, output_len)
