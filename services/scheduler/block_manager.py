"""Physical KV block pool: allocation on demand, reference counts, copy-on-write, prefix cache.

Pure bookkeeping over block ids; it knows nothing about models, tensors or sockets.
A new sequence is admitted in two calls, as in vLLM v1: `get_computed_blocks` looks its
cached prefix up once, and `allocate_slots` takes those blocks plus room for the tokens to
compute, or returns None, changing nothing, when they do not fit. A running sequence grows
by a pair, a side-effect-free "can" and a "do" (`can_append`/`append_slots`; likewise
`can_restore`/`restore` for one coming back from swap), plus `fork` and `free`; `trim` gives
back the slots of speculated tokens the model rejected. Of a sequence
(`services/scheduler/sequence.py`'s `Sequence`, or any object with these fields) it reads
and writes only its `block_table` (block i holds token positions
[i * block_size, (i + 1) * block_size)), `num_computed_tokens`, its tokens (`num_tokens`,
`token_ids(start, stop)`), the `block_hashes` list this class fills in, and optionally
`cache_salt` and `no_cache_hits`.

Prefix caching: a block full of computed tokens is registered under its digest,
a SHA-256 chain over the sequence's tokens seeded by its cache salt
(`shared/block_digest.py`): digest_i = SHA-256(digest_{i-1} + block i's tokens as int64
little-endian), digest_{-1} = 32 zero bytes, or SHA-256(b"pagedserve-cache-salt\0" + salt)
for a request with a `cache_salt`. A digest commits to the whole prefix and the salt, so a
hit needs no token comparison, no prompt can be made to collide with another's (Python's
`hash` could), and requests with different salts never share a block. When no sequence
references it any more it stays in the
pool as "cached"; a new sequence whose leading blocks hash the same takes them
instead of computing them. Cached blocks nobody holds are evicted least recently
used when a block is needed. A block is registered only by `commit`, once the step
that writes its KV has succeeded: a block handed out for a step that then fails
holds no KV, and caching it would hand garbage to the next request with that prefix.

KV cache events: while `events` is a list (None, the default, records nothing), every change
to the cache is appended to it in vLLM's wire format (`shared/kv_events.py`): a `BlockStored`
for each run of consecutive blocks `commit` registers (their hashes, the parent's, their
tokens), a `BlockRemoved` for a cached block evicted to be reused, an `AllBlocksCleared` from
`reset_cache`. The scheduler stage drains the list once a step and publishes it; several
managers (a pool rebuilt for a new executor) may share one list.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shared.block_digest import chain_digests, root_digest
from shared.kv_events import MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, external_hash

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # holds nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self._cached: dict[bytes, int] = {}  # digest -> block
        self._block_key: dict[int, bytes] = {}  # block -> digest
        self.prefix_cache_queries = 0  # tokens looked up in the cache
        self.prefix_cache_hits = 0  # of which found
        self.events: list | None = None  # KV cache events, recorded while a list (see the module doc)

    # --- counts ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: never used, or cached but held by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks that sequences hold."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks no sequence holds (kept for reuse until evicted)."""
        return len(self._evictable)

    @property
    def max_sequence_blocks(self) -> int:
        """The most blocks one sequence can ever hold: any block serves, so all of them."""
        return self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_unreferenced(self) -> list[int]:
        """The cached blocks no sequence holds, least recently used first."""
        return list(self._evictable)

    # --- prefix cache ---------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Chained digests of seq's full blocks within its first num_tokens tokens."""
        bs, hashes, full = self.block_size, seq.block_hashes, num_tokens // self.block_size
        if len(hashes) < full:
            parent = hashes[-1] if hashes else root_digest(getattr(seq, "cache_salt", None), getattr(seq, "lora_digest", None))
            hashes += chain_digests(parent, seq.token_ids(len(hashes) * bs, full * bs), bs)
        return hashes[:full]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading tokens, always leaving one token to compute:
        looked up once per admission and handed to `allocate_slots` (valid until the pool
        changes)."""
        if not self.enable_prefix_caching or getattr(seq, "no_cache_hits", False):
            return []  # (a prompt being scored computes every position)
        hits = []
        for h in self._hashes(seq, seq.num_tokens - 1):
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def commit(self, seq: Sequence, start: int, end: int) -> None:
        """The KV of seq's tokens [start, end) is written: cache the blocks they complete."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq, end)
        stored: list[int] = []  # a run of consecutive blocks registered now, for the event
        for i in range(start // self.block_size, len(hashes)):
            block, h = seq.block_table[i], hashes[i]
            if block in self._block_key or h in self._cached:
                if stored:  # already cached, or the same prefix cached in another block
                    self._record_stored(seq, stored, hashes)
                    stored = []
                continue
            self._cached[h] = block
            self._block_key[block] = h
            if self.events is not None:
                stored.append(i)
        if stored:
            self._record_stored(seq, stored, hashes)

    def _record_stored(self, seq: Sequence, run: list[int], hashes: list[bytes]) -> None:
        """One BlockStored for seq's blocks run (consecutive indices), chained to the block before."""
        bs, first = self.block_size, run[0]
        self.events.append(BlockStored(
            [external_hash(hashes[i]) for i in run], external_hash(hashes[first - 1]) if first else None,
            seq.token_ids(first * bs, (run[-1] + 1) * bs), bs, None, MEDIUM))

    def _uncache(self, block: int) -> None:
        digest = self._block_key.pop(block)
        del self._cached[digest]
        if self.events is not None:
            self.events.append(BlockRemoved([external_hash(digest)], MEDIUM))

    def reset_cache(self) -> None:
        """Forget every cached block (the KV memory behind them was lost)."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._cached.clear()
        self._block_key.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    # --- taking and releasing blocks ------------------------------------------------

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        self.ref_counts[block] = 1
        return block

    def _reuse(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._block_key:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # --- a new sequence -------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int]) -> list[int] | None:
        """Give a sequence holding no blocks its computed blocks (`get_computed_blocks`) and
        blocks for num_new_tokens more tokens past them; sets seq.num_computed_tokens to the
        cached length. Returns the blocks taken new, or None, with nothing changed, when
        they do not fit (or seq holds blocks already)."""
        if seq.block_table:
            return None
        num_computed = len(computed_blocks) * self.block_size
        new = self.blocks_for(num_computed + num_new_tokens) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)  # leave the free count
        if new + revived > self.num_free_blocks:
            return None
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_computed
        for block in computed_blocks:
            self._reuse(block)
        taken = [self._take() for _ in range(new)]
        seq.block_table += computed_blocks + taken
        seq.num_computed_tokens = num_computed
        return taken

    # --- a swapped-out sequence comes back -----------------------------------------

    def can_restore(self, seq: Sequence, num_new_tokens: int) -> bool:
        return not seq.block_table and self.blocks_for(seq.num_computed_tokens + num_new_tokens) <= self.num_free_blocks

    def restore(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Fresh blocks for a sequence whose computed KV comes back from swap space,
        plus room for num_new_tokens; returns the blocks the swapped KV goes into."""
        if not self.can_restore(seq, num_new_tokens):
            raise RuntimeError("restore without room: call can_restore first")
        end = seq.num_computed_tokens + num_new_tokens
        seq.block_table.extend(self._take() for _ in range(self.blocks_for(end)))
        return seq.block_table[: self.blocks_for(seq.num_computed_tokens)]

    # --- a running sequence grows ---------------------------------------------------

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the table of the block the next write lands in, if others share it."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        end = seq.num_computed_tokens + num_new_tokens
        need = max(0, self.blocks_for(end) - len(seq.block_table))
        if self._shared_write_block(seq) is not None:
            need += 1
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for num_new_tokens more tokens; returns (src, dst) block copies.

        A block shared with another sequence is never written: the first write into
        it gets a private copy (copy-on-write), which the executor performs first.
        """
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError("append_slots without room: call can_append first")
        copies = []
        idx = self._shared_write_block(seq)
        if idx is not None:
            src = seq.block_table[idx]
            dst = self._take()
            self._release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        end = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_for(end):
            seq.block_table.append(self._take())
        return copies

    # --- sharing and release --------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (parallel sampling, beams)."""
        if child.block_table:
            raise RuntimeError("fork into a sequence that already holds blocks")
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table.extend(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        # Tail blocks first: they are the least likely to be shared prefixes, so LRU
        # eviction takes them before the heads of the same sequence.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table.clear()

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Speculative decoding's rollback: keep only the blocks that hold seq's first num_tokens
        positions (its verified, computed tokens). A block whose first slot held a rejected token
        goes back to the pool; the rejected slots of a kept block are written over by the next
        step. Never cached: `commit` only registers blocks full of verified tokens."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def slot_mapping(self, seq: Sequence, start: int, num_tokens: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    # --- invariants -----------------------------------------------------------------

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless the pool is consistent with these block tables."""
        refs = Counter(b for table in tables for b in table)
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and cached-evictable"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == refs.get(block, 0), f"ref count of block {block}"
            unheld = block in free or block in evictable
            assert unheld == (self.ref_counts[block] == 0), f"block {block} free/used"
        assert all(b in self._block_key for b in evictable), "an evictable block is not cached"
        assert not any(b in self._block_key for b in free), "a free-list block is still cached"
        assert {b: h for h, b in self._cached.items()} == self._block_key, "digest and block maps disagree"
        assert all(len(h) == 32 for h in self._cached), "a cache key is not a SHA-256 digest"
        assert len(free) + len(evictable) + sum(1 for r in self.ref_counts if r > 0) == self.num_blocks
