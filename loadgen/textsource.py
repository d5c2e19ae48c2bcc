"""Real English text to cut prompts from: Python's own documentation topics.

`pydoc_data.topics` ships with every CPython (the text of `help()`), so prompts are real
prose with no download, the same for every run on one Python version. A prompt of N
tokens is a window of N tokens of this text, starting at a seeded random offset.
"""

from __future__ import annotations

import random

from loadgen.tokenizer import Tokenizer


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


_CORPORA: dict[int, tuple[Tokenizer, TokenCorpus]] = {}


def corpus_for(tokenizer: Tokenizer) -> TokenCorpus:
    """One tokenized corpus per tokenizer: encoding the whole text takes a moment."""
    if id(tokenizer) not in _CORPORA:
        _CORPORA[id(tokenizer)] = (tokenizer, TokenCorpus(tokenizer))  # keeps the id's owner alive
    return _CORPORA[id(tokenizer)][1]


class TokenCorpus:
    def __init__(self, tokenizer: Tokenizer, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(corpus_text() if text is None else text)
        if not self.ids:
            raise ValueError("the text corpus is empty")

    def window(self, rng: random.Random, n: int) -> tuple[str, int]:
        """Text of about n tokens and its exact token count when encoded again.

        Decoding a token window and encoding the text back can merge or split tokens at
        the cut, so the window is adjusted a few times until the count is right.
        """
        start = rng.randrange(len(self.ids))
        want = n
        text, count = "", 0
        for _ in range(4):
            text = self.tokenizer.decode(self._take(start, want))
            count = len(self.tokenizer.encode(text))
            if count == n or want < 1:
                break
            want = max(1, want + n - count)
        return text, count

    def _take(self, start: int, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:  # wraps around a corpus shorter than the window
            out.extend(self.ids[start:start + n - len(out)])
            start = 0
        return out
