"""KV cache events: what the block manager records, encoded as the scheduler publishes it,
decoded by a reader written from vLLM's published schema (vllm/distributed/kv_events.py:
array-like Structs, events tagged by class name), independent of shared.kv_events; and the
publisher's framing and replay socket."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from services.scheduler.options import KVEventsOptions
from services.scheduler.service import kv_event_publisher
from shared.block_digest import block_digests
from shared.curve import CurveKeyError
from shared.kv_events import KVEventBatch, external_hash, offset_endpoint
from shared.ports import free_port
from shared.transport import KVEventPublisher
from tests.scheduler.test_block_manager import Seq, admit

# --- a subscriber's decoder, from vLLM's schema -------------------------------------------

class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def drain(bm: BlockManager, rank: int = 0) -> list:
    """The events recorded so far, through the wire and vLLM's decoder."""
    batch = KVEventBatch(123.5, list(bm.events), rank)
    bm.events.clear()
    decoded = DECODER.decode(msgspec.msgpack.encode(batch))
    assert decoded.ts == 123.5 and decoded.data_parallel_rank == rank
    return decoded.events


def h(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def test_external_hash_is_the_digests_first_8_bytes_as_signed_int64():
    assert external_hash(bytes([0x80] + [0] * 31)) == -(1 << 63)
    assert external_hash(bytes([0x7F] + [0xFF] * 7 + [1] * 24)) == (1 << 63) - 1
    assert external_hash(bytes(range(32))) == 0x0001020304050607


def test_stored_chain_carries_parents_and_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.events = []
    seq = Seq(tokens=list(range(100, 111)))  # 2 full blocks and 3 tokens
    admit(bm, seq)
    digests = block_digests(seq.tokens, 4)
    [stored] = drain(bm)
    assert isinstance(stored, VBlockStored)
    assert stored.block_hashes == [h(d) for d in digests]
    assert stored.parent_block_hash is None  # the sequence's first block
    assert stored.token_ids == list(range(100, 108))
    assert stored.block_size == 4 and stored.lora_id is None and stored.medium == "GPU"

    # a sequence sharing the first block: only its new second block is stored, chained to the first
    other = Seq(tokens=list(range(100, 104)) + [7, 7, 7, 7, 9])
    assert admit(bm, other) == 4
    [more] = drain(bm)
    assert more.block_hashes == [h(block_digests(other.tokens, 4)[1])]
    assert more.parent_block_hash == h(digests[0])
    assert more.token_ids == [7, 7, 7, 7]
    bm.check_invariants([seq.block_table, other.block_table])


def test_eviction_is_a_removal_and_reset_clears_all():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.events = []
    first = Seq(tokens=[1, 2, 3, 4, 5])  # 3 blocks, 2 of them cached
    admit(bm, first)
    bm.free(first)
    drain(bm)
    second = Seq(tokens=[9, 9, 9])  # needs 2 blocks: the free one and the LRU cached one
    admit(bm, second)
    events = drain(bm)
    removed = [e for e in events if isinstance(e, VBlockRemoved)]
    assert len(removed) == 1 and removed[0].medium == "GPU"
    assert removed[0].block_hashes[0] in {h(d) for d in block_digests(first.tokens, 2)}
    assert [type(e) for e in events] == [VBlockRemoved, VBlockStored]  # evicted at admission, stored on commit
    bm.free(second)
    bm.reset_cache()
    assert [type(e) for e in drain(bm)] == [VAllBlocksCleared]
    bm.check_invariants([])


def test_nothing_is_recorded_unless_enabled():
    bm = BlockManager(num_blocks=4, block_size=2)
    admit(bm, Seq(tokens=[1, 2, 3]))
    bm.reset_cache()
    assert bm.events is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "free", "reset"]), st.lists(st.integers(0, 3), min_size=1,
                                                                                max_size=9)), max_size=14))
def test_a_subscriber_replaying_the_events_sees_the_cache(ops):
    """Stored minus removed, emptied by all-cleared, is the set of cached blocks' hashes."""
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.events = []
    live: list[Seq] = []
    seen: set[int] = set()
    for action, tokens in ops:
        if action == "reset":
            while live:
                bm.free(live.pop())
            bm.reset_cache()
        elif action == "free" and live:
            bm.free(live.pop(0))
        else:
            seq = Seq(tokens=tokens)
            computed = bm.get_computed_blocks(seq)
            if bm.allocate_slots(seq, seq.num_tokens - len(computed) * 2, computed) is not None:
                seq.num_computed_tokens = seq.num_tokens
                bm.commit(seq, len(computed) * 2, seq.num_tokens)
                live.append(seq)
        for event in drain(bm):
            if isinstance(event, VBlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * 2
                assert not seen & set(event.block_hashes), "a block stored twice"
                seen |= set(event.block_hashes)
            elif isinstance(event, VBlockRemoved):
                assert set(event.block_hashes) <= seen, "a block removed that was not stored"
                seen -= set(event.block_hashes)
            else:
                seen.clear()
        assert seen == {h(d) for d in bm._cached}
        bm.check_invariants([s.block_table for s in live])


# --- the publisher ---------------------------------------------------------------------

def test_offset_endpoint_by_rank():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("ipc:///tmp/kv.ipc", 1) == "ipc:///tmp/kv.ipc-dp1"
    with pytest.raises(ValueError):
        offset_endpoint("tcp://127.0.0.1", 1)


def test_publisher_frames_and_replays():
    ctx = zmq.Context()
    try:
        port, replay_port = free_port(), free_port()
        pub = KVEventPublisher(ctx, f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                               topic="kv@pod@tiny")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(f"tcp://127.0.0.1:{port}")
        batch = KVEventBatch(1.0, [], 0)
        # a SUB socket misses what is sent before its subscription arrives: publish until one lands
        for _ in range(200):
            pub.publish(batch)
            if sub.poll(20):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@pod@tiny" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        pub.publish(batch)
        assert int.from_bytes(sub.recv_multipart()[1], "big") == first + 1
        assert DECODER.decode(payload).events == []

        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart([b"", (first + 1).to_bytes(8, "big")])
        for _ in range(100):
            if pub.serve_replay():
                break
            req.poll(20)
        assert req.poll(2000)
        assert req.recv_multipart() == [b"", (first + 1).to_bytes(8, "big"), payload]
        assert req.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        pub.close()
    finally:
        ctx.destroy(linger=0)


def test_network_endpoints_need_an_explicit_allow():
    ctx = zmq.Context()
    try:
        with pytest.raises(CurveKeyError):
            KVEventPublisher(ctx, f"tcp://*:{free_port()}")
        options = KVEventsOptions(kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}")
        assert kv_event_publisher(ctx, KVEventsOptions(), "engine-0") == (None, 0)
        publisher, rank = kv_event_publisher(ctx, options, "engine-0")
        assert rank == 0 and publisher.endpoint == options.kv_events_endpoint
        publisher.close()
    finally:
        ctx.destroy(linger=0)


def test_serve_forwards_the_endpoint_and_each_engine_publishes_on_port_plus_rank():
    """`pagedserve serve --data-parallel-size 2 --kv-events-endpoint ...`: each scheduler's own
    parser reads the same endpoint, and its engine's rank moves it to port + rank."""
    import argparse

    from services import launcher
    from services.stage_options import add_stage_args
    from shared.config import Addresses
    from shared.options import from_args

    base = free_port()
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    args = parser.parse_args(["--model", "tiny", "--data-parallel-size", "2",
                              "--kv-events-endpoint", f"tcp://127.0.0.1:{base}", "--kv-events-topic", "kv"])
    ctx = zmq.Context()
    try:
        endpoints = {}
        for name, cmd in launcher.stage_commands(args, Addresses.ipc("/tmp/run")).items():
            if not name.startswith("scheduler"):
                continue
            own = argparse.ArgumentParser()
            add_stage_args(own, "scheduler")
            stage = own.parse_args(cmd[cmd.index("scheduler") + 1:])
            publisher, rank = kv_event_publisher(ctx, from_args(KVEventsOptions, stage), stage.engine)
            endpoints[name] = (publisher.endpoint, rank, publisher.topic)
            publisher.close()
        assert endpoints == {"scheduler-0": (f"tcp://127.0.0.1:{base}", 0, b"kv"),
                             "scheduler-1": (f"tcp://127.0.0.1:{base + 1}", 1, b"kv")}
    finally:
        ctx.destroy(linger=0)
