"""What a token looks like on its own, for logprobs: its text and its UTF-8 bytes.

The bytes are the token's own: byte-level BPE tokens (GPT-2, Llama 3, SmolLM2) map each
character back to the byte it stands for, SentencePiece byte tokens (`<0xE2>`) are that
byte and `▁` is a space; other tokenizers fall back to decoding the token alone. A token
that is not valid UTF-8 on its own (part of a multi-byte character) shows as
`bytes:\\xe2\\x80`, as OpenAI and vLLM show it; its bytes are exact, so a client can join
them. Results are cached per token id.
"""

from __future__ import annotations

import json
import re

from shared.messages import TokenLogprob

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer) -> bool:
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


class TokenTexts:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.tokenizer = tokenizer
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def bytes_of(self, token_id: int) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return []
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        match = _SP_BYTE.match(piece)
        if match:
            return [int(match.group(1), 16)]
        if piece.startswith("▁") or "▁" in piece:
            return list(piece.replace("▁", " ").encode("utf-8"))
        return list(self._tokenizer.decode([token_id]).encode("utf-8"))

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self.bytes_of(token_id)
            try:
                text = bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit

    def fill(self, entries: list[TokenLogprob]) -> list[TokenLogprob]:
        """The entries (and their top candidates) with token and bytes set, in place."""
        for entry in entries:
            entry.token, entry.bytes = self.get(entry.token_id)
            for top in entry.top:
                top.token, top.bytes = self.get(top.token_id)
        return entries
