"""KV cache events in vLLM's wire format, for KV-aware routers outside the engine.

The scheduler stage (with `--kv-events-endpoint`) tells subscribers which prefix-cache blocks
its pool holds, so that a router (llm-d's KV cache indexer, Dynamo's ZMQ relay, vLLM's own
`examples/online_serving/kv_events_subscriber.py`) sends a request where its prefix is cached.
The messages are those of vLLM's `vllm/distributed/kv_events.py` (`KVEventBatch`,
`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), written here from that published schema
so that its consumers decode them unchanged:

- msgpack; every Struct is array-like (fields by position, not by name) with defaults left
  out at the end, and an event is tagged with its class name as the array's first element:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
  `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
- a batch is `[ts, events, data_parallel_rank]` (ts: Unix time in seconds, the rank always
  sent, as the consumers above read three elements);
- on the PUB socket each batch is one multipart message `[topic, seq, payload]`: the topic
  (empty unless configured), the batch's sequence number as 8 bytes big-endian counting from
  0, and the msgpack payload. A subscriber that sees a gap asks the optional replay ROUTER
  socket for the batches from a sequence number on (`shared.transport.KVEventPublisher`).

This is the array layout vLLM published from its first KV events release on and that the
consumers above decode; later vLLM releases may also emit a by-name layout, which this module
does not.

Block hashes: the pool keys a block by a 32-byte SHA-256 chain digest (`shared.block_digest`);
the consumers expect 64-bit integers, so an event carries `external_hash(digest)`, the digest's
first 8 bytes read big-endian as a signed int64. A parent of None marks a sequence's first
block (the digest's chain root, and a request's cache salt, are folded into the hash itself).
`lora_id` is always None (no adapters), and `medium` is "GPU", vLLM's name for the engine's
own KV pool (also on the CPU backend: there is no other tier to tell it from).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

MEDIUM = "GPU"  # vLLM's name for blocks in the engine's own KV pool


def external_hash(digest: bytes) -> int:
    """The 64-bit hash a block's event carries: the first 8 bytes of its SHA-256 chain
    digest, big-endian, as a signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


class KVCacheEvent(Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache; tagged by its class name."""


class BlockStored(KVCacheEvent):
    """Full blocks now cached: block_hashes[i] holds token_ids[i * block_size:(i + 1) * block_size],
    each block the child of the one before, the first of parent_block_hash (None: the first
    block of a sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the cache (their KV is overwritten)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block is gone (the cache was reset, or the executor lost its KV)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one scheduler step, in order."""

    ts: float
    events: list[Any]  # KVEvent
    data_parallel_rank: int | None = None


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint engine `rank` publishes on, as vLLM numbers them: a tcp:// port plus the
    rank; an ipc:// or inproc:// name with "-dp{rank}" added (rank 0: the endpoint itself)."""
    if rank == 0 or not endpoint:
        return endpoint
    scheme, sep, rest = endpoint.partition("://")
    if scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if not colon or not port.isdigit():
            raise ValueError(f"{endpoint}: a tcp:// endpoint needs a port to offset by the engine's rank")
        return f"tcp://{host}:{int(port) + rank}"
    if scheme in ("ipc", "inproc") and sep:
        return f"{endpoint}-dp{rank}"
    raise ValueError(f"{endpoint}: KV events go to a tcp://, ipc:// or inproc:// endpoint")
