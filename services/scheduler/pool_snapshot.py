"""The scheduler's KV pool packed for a dashboard: `pool_snapshot(scheduler, ...)`.

Reads the allocator (the paged `BlockManager` or a reservation baseline), the running
and waiting sequences and the host swap space, and packs one entry per block into
byte arrays (`shared.messages.PoolSnapshot` documents the layout): a pool of 10,000
blocks is about 90 KB and a few milliseconds. It changes nothing; the scheduler's loop
calls it between steps, never while the pool is mid-change.

For the paged pool, reference counts are the block manager's own; for a reservation
baseline (which shares nothing) they are counted from the block tables, and a chunk's
blocks no table lists (held for a fork that has not started, or the buddy allocator's
rounding past a reservation) are "reserved".
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Iterable

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_accounting import kv_usage
from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import Sequence, SequenceStatus
from shared.messages import (
    BLOCK_CACHED,
    BLOCK_RESERVED,
    BLOCK_SWAPPED,
    PoolRow,
    PoolSnapshot,
)

MAX_ROWS = 512  # sequences listed; blocks of the others still show their state
_U16_MAX = 0xFFFF


def pack_u16(values: Iterable[int]) -> bytes:
    return _pack("H", values)


def pack_u32(values: Iterable[int]) -> bytes:
    return _pack("I", values)


def _pack(typecode: str, values: Iterable[int]) -> bytes:
    packed = array(typecode, values)
    assert packed.itemsize == {"H": 2, "I": 4}[typecode]
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack(typecode: str, data: bytes) -> list[int]:
    """The inverse of the packers ("H" for uint16, "I" for uint32), for readers and tests."""
    values = array(typecode)
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _row(req: Sequence) -> PoolRow:
    if req.status is SequenceStatus.RUNNING:
        status = "running"
    else:
        status = "swapped" if req.swapped_blocks else "waiting"
    return PoolRow(
        request_id=req.request_id, seq_index=req.seq_index, status=status,
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        num_computed_tokens=req.num_computed_tokens, max_tokens=req.params.max_tokens,
        num_preemptions=req.num_preemptions, block_table=list(req.block_table),
        swapped_blocks=list(req.swapped_blocks),
    )


def pool_snapshot(scheduler: Scheduler, engine: str, instance: str, kv_policy: str) -> PoolSnapshot:
    blocks = scheduler.blocks
    n, bs = blocks.num_blocks, blocks.block_size
    seqs = [*scheduler.running, *scheduler.waiting]
    listed = seqs[:MAX_ROWS]

    if isinstance(blocks, BlockManager):
        refs = blocks.ref_counts
        states = bytearray(min(r, 2) for r in refs)  # BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED
        cached = blocks.cached_unreferenced()
    else:
        refs = [0] * n
        for seq in seqs:
            for b in seq.block_table:
                refs[b] += 1
        states = bytearray(min(r, 2) for r in refs)
        cached = []
        for start, length in blocks.runs():
            for b in range(start, start + length):
                if refs[b] == 0:  # a chunk held for a fork, or the allocator's rounding past a table
                    states[b] = BLOCK_RESERVED

    owners = [0] * n
    fill = [0] * n
    for b in cached:
        states[b] = BLOCK_CACHED
        fill[b] = bs  # only full blocks are cached
    for i in range(len(seqs) - 1, -1, -1):  # the first listed holder names a shared block
        seq = seqs[i]
        computed = seq.num_computed_tokens
        for j, b in enumerate(seq.block_table):
            if i < len(listed):
                owners[b] = i + 1
            f = min(max(computed - j * bs, 0), bs)
            if f > fill[b]:
                fill[b] = f

    swap = scheduler.swap
    num_swap = swap.num_blocks if swap is not None else 0
    swap_states = bytearray(num_swap)  # zeros: BLOCK_FREE
    swap_owners = [0] * num_swap
    for i, seq in enumerate(seqs):
        for b in seq.swapped_blocks:
            swap_states[b] = BLOCK_SWAPPED
            swap_owners[b] = i + 1 if i < len(listed) else 0

    usage = kv_usage(scheduler)
    return PoolSnapshot(
        engine=engine, instance=instance, sent_at=time.time(), kv_policy=kv_policy, block_size=bs, num_blocks=n,
        states=bytes(states), owners=pack_u32(owners), ref_counts=pack_u16(min(r, _U16_MAX) for r in refs),
        fill=pack_u16(fill), rows=[_row(r) for r in listed], num_rows_total=len(seqs),
        num_swap_blocks=num_swap, swap_states=bytes(swap_states), swap_owners=pack_u32(swap_owners),
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_swapped=sum(1 for r in scheduler.waiting if r.swapped_blocks),
        num_preemptions_total=scheduler.num_preemptions_total,
        num_swapped_out_total=scheduler.num_swapped_out_total, num_swapped_in_total=scheduler.num_swapped_in_total,
        prefix_cache_queries_total=blocks.prefix_cache_queries, prefix_cache_hits_total=blocks.prefix_cache_hits,
        kv_slots_token_states=int(usage.token_states), kv_slots_reserved=int(usage.reserved),
        kv_slots_internal_frag=int(usage.internal_frag), kv_slots_external_frag=int(usage.external_frag),
        kv_slots_free=int(usage.free),
    )
