"""Prefix-cache block keys: a SHA-256 chain over the tokens of full KV blocks.

A block's key commits to every token before its end and to the request's cache salt, so
two blocks share a key only if their whole prefixes (and salts) are equal:

    root     = 32 zero bytes                              (no cache_salt)
             = SHA-256(b"pagedserve-cache-salt\\0" + salt as UTF-8)   (cache_salt set)
             = SHA-256(b"pagedserve-lora\\0" + adapter digest (64 hex) + b"\\0" + salt, or b"\\1" without)
                                                          (a LoRA adapter: the same tokens under
                                                           another adapter are other KV)
    digest_i = SHA-256(digest_{i-1} (root for i = 0) + tokens of block i as int64 little-endian)

Each block holds exactly block_size tokens, so the encoding is unambiguous. The scheduler's
block manager keys its prefix cache by these digests, and the tokenizer's engine router
its prefix map, so both name a block the same way (the block size being the pool's).
Python's `hash` was used before: it is not collision resistant (ints hash mod 2**61 - 1), so
a tenant could plant KV that another tenant's prompt would reuse (vLLM CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
import sys
from array import array

NO_SALT_ROOT = bytes(32)
_SALT_PREFIX = b"pagedserve-cache-salt\0"
_LORA_PREFIX = b"pagedserve-lora\0"


def root_digest(salt: str | None, lora_digest: str | None = None) -> bytes:
    """The parent of a request's first block: requests with different salts, or under different
    LoRA adapters (their files' digests, a fixed 64 hex characters), share nothing."""
    if lora_digest is not None:
        tail = b"\1" if salt is None else b"\0" + salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(_LORA_PREFIX + lora_digest.encode("ascii") + tail).digest()
    if salt is None:
        return NO_SALT_ROOT
    return hashlib.sha256(_SALT_PREFIX + salt.encode("utf-8", "surrogatepass")).digest()


def chain_digests(parent: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Digests of the full blocks of token_ids (a whole number of blocks, or the tail is
    ignored), the first one chained to parent."""
    encoded = array("q", token_ids)
    if sys.byteorder == "big":
        encoded.byteswap()
    view, step = memoryview(encoded).cast("B"), 8 * block_size
    digests = []
    sha256 = hashlib.sha256
    for start in range(0, len(token_ids) // block_size * step, step):
        parent = sha256(parent + view[start:start + step]).digest()
        digests.append(parent)
    return digests


def block_digests(token_ids: list[int], block_size: int, salt: str | None = None,
                  lora_digest: str | None = None) -> list[bytes]:
    """The chained digests of every full block of a prompt."""
    return chain_digests(root_digest(salt, lora_digest), token_ids, block_size)
