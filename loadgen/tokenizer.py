"""Tokenizers that cut prompts to a drawn length: a served model's own, or a plain word splitter.

A model alias pagedserve knows (`smollm2`) or a Hugging Face directory loads with
transformers' AutoTokenizer; `words` needs nothing and counts whitespace-separated words,
for targets whose tokenizer is unknown and for tests.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class WordTokenizer:
    """One token per word, with the whitespace before it; decode(encode(t)) == t."""

    _PIECE = re.compile(r"\s*\S+|\s+$")

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in self._PIECE.findall(text):
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(self._ids[piece])
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in ids)


class HFTokenizer:
    """A model directory's tokenizer.json through `tokenizers` (seconds faster to load than
    transformers); AutoTokenizer for directories without one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer as Fast

            fast = Fast.from_file(str(path / "tokenizer.json"))
            self._encode = lambda text: fast.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: fast.decode(ids, skip_special_tokens=True)
        else:
            from shared.model_files import load_tokenizer

            slow = load_tokenizer(path)
            self._encode = lambda text: slow.encode(text, add_special_tokens=False)
            self._decode = lambda ids: slow.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


def tokenizer_for(name: str) -> Tokenizer:
    if name == "words":
        return WordTokenizer()
    path = Path(name).expanduser()
    if path.is_dir():
        return HFTokenizer(path)
    from shared.model_files import resolve_model

    return HFTokenizer(resolve_model(name))
