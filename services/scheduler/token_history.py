"""An append-only token list whose copies share their past: a beam's output tokens.

Beams fork every step; copying a beam's whole output at each fork makes a step's work
grow with the output length. Here each history is a pointer to its newest token in
a chain of (token, previous) pairs shared with every beam it forked from: `fork`,
`append`, `len` and reading the last few tokens (a beam's next input) are O(1) or
O(tokens read); only reading the whole output (a recompute, the final answer) walks
the chain. Tokens no live history reaches are freed with the beams that held them.
"""

from __future__ import annotations

from collections.abc import Iterator


class TokenHistory:
    __slots__ = ("_len", "_node")

    def __init__(self, tokens: list[int] = ()):
        self._node: tuple | None = None  # (newest token, the node before it)
        self._len = 0
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        self._node = (token, self._node)
        self._len += 1

    def fork(self) -> TokenHistory:
        """A copy that shares every token so far; either may grow on its own."""
        copy = TokenHistory()
        copy._node, copy._len = self._node, self._len
        return copy

    def __len__(self) -> int:
        return self._len

    def _read(self, skip: int, count: int) -> list[int]:
        """count tokens, oldest first, ending skip tokens before the newest."""
        node = self._node
        for _ in range(skip):
            node = node[1]
        out = []
        for _ in range(count):
            out.append(node[0])
            node = node[1]
        out.reverse()
        return out

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return list(self)[index]
            return self._read(self._len - stop, stop - start) if stop > start else []
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("token history index out of range")
        return self._read(self._len - 1 - index, 1)[0]

    def __iter__(self) -> Iterator[int]:
        return iter(self._read(0, self._len))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenHistory | list):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"TokenHistory({list(self)!r})"
