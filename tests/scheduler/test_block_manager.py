"""Block manager: allocation on demand, copy-on-write, prefix caching, and invariants
under random sequences of operations (hypothesis)."""

import hashlib
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from shared.block_digest import block_digests


@dataclass(eq=False)
class Seq:
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids(self, start, stop):
        return self.tokens[start:stop]


def cached_tokens(bm: BlockManager, seq: Seq) -> int:
    return len(bm.get_computed_blocks(seq)) * bm.block_size


def admit(bm: BlockManager, seq: Seq) -> int:
    """Allocate a new sequence's uncached tokens; returns the cached token count."""
    computed = bm.get_computed_blocks(seq)
    cached = len(computed) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - cached, computed) is not None
    assert seq.num_computed_tokens == cached
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq, cached, seq.num_tokens)
    return cached


def grow(bm: BlockManager, seq: Seq, new_tokens: list[int]) -> list[tuple[int, int]]:
    seq.tokens += new_tokens
    copies = bm.append_slots(seq, len(new_tokens))
    bm.commit(seq, seq.num_computed_tokens, seq.num_computed_tokens + len(new_tokens))
    seq.num_computed_tokens += len(new_tokens)
    return copies


def test_allocates_on_demand_at_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(tokens=list(range(5)))
    admit(bm, seq)
    assert len(seq.block_table) == 2
    for t in range(3):  # tokens 6..8 fill block 2
        grow(bm, seq, [t])
    assert len(seq.block_table) == 2
    grow(bm, seq, [9])
    assert len(seq.block_table) == 3
    assert bm.slot_mapping(seq, 8, 1) == [seq.block_table[2] * 4]
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and bm.num_used_blocks == 0


def test_what_does_not_fit_is_refused_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    a = Seq(tokens=list(range(9)))
    assert bm.allocate_slots(a, 9, []) is None
    assert a.block_table == [] and bm.num_free_blocks == 2
    a.tokens = a.tokens[:8]
    admit(bm, a)
    a.tokens.append(1)
    assert not bm.can_append(a, 1)
    with pytest.raises(RuntimeError):
        bm.append_slots(a, 1)


def test_fork_shares_blocks_and_first_write_copies_the_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Seq(tokens=list(range(6)))  # one full block, one partial
    admit(bm, parent)
    child = Seq(tokens=list(parent.tokens))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.num_used_blocks == 2
    copies = grow(bm, child, [100])
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent.block_table[1] and dst == child.block_table[1] and src != dst
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert grow(bm, parent, [200]) == []  # the parent now owns its partial block alone
    bm.check_invariants([parent.block_table, child.block_table])
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0


def test_prefix_cache_reuses_full_blocks_of_matching_prompts_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Seq(tokens=list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    assert admit(bm, a) == 0
    b = Seq(tokens=list(range(8)) + [50, 51, 52])
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    c = Seq(tokens=[0, 1, 2, 99] + list(range(4, 10)))  # differs in the first block
    assert admit(bm, c) == 0
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 10 + 11 + 10
    bm.check_invariants([a.block_table, b.block_table, c.block_table])


def test_an_exact_repeat_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq(tokens=list(range(8)))
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    again = Seq(tokens=list(range(8)))
    assert admit(bm, again) == 4  # the second block is recomputed into a fresh block


def test_cached_blocks_survive_free_and_are_evicted_least_recently_used():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = Seq(tokens=[1, 2, 3]), Seq(tokens=[7, 8, 9])
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    filler = Seq(tokens=[5, 5, 5, 5, 5])  # needs 3 blocks: 2 never used + evict the oldest
    admit(bm, filler)
    assert cached_tokens(bm, Seq(tokens=[1, 2, 3])) == 0  # the older one was evicted
    assert cached_tokens(bm, Seq(tokens=[7, 8, 0])) == 2
    bm.check_invariants([filler.block_table])


def test_prompts_whose_python_hashes_collide_share_no_block():
    """Python hashes ints mod 2**61 - 1, so under `hash((parent, tokens))` keys the prompts
    [5, 6, ...] and [5 + 2**61 - 1, 6, ...] chain to the same keys; the old hit check
    compared only a block's own tokens, so a victim's second block reused the KV the
    attacker computed after another first block. (Validated token ids stay below 2**31,
    where the same collision takes an offline search instead of an addition.)"""
    bm = BlockManager(num_blocks=16, block_size=2)
    honest = Seq(tokens=[5, 6, 0])
    admit(bm, honest)
    attacker = Seq(tokens=[5 + 2**61 - 1, 6, 1, 2, 0])
    assert admit(bm, attacker) == 0
    victim = Seq(tokens=[5, 6, 1, 2, 7])
    assert admit(bm, victim) == 2  # the honest first block only
    assert victim.block_table[0] == honest.block_table[0]
    assert victim.block_table[1] != attacker.block_table[1]
    bm.check_invariants([honest.block_table, attacker.block_table, victim.block_table])


def test_block_keys_are_the_documented_sha256_chain():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 113))
    for salt in (None, "tenant-a"):
        seq = Seq(tokens=list(tokens), cache_salt=salt)
        admit(bm, seq)
        parent = bytes(32) if salt is None else hashlib.sha256(b"pagedserve-cache-salt\0" + salt.encode()).digest()
        want = []
        for i in range(3):
            parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens[4 * i:4 * i + 4])).digest()
            want.append(parent)
        assert seq.block_hashes == want == block_digests(tokens, 4, salt)
        assert [bm._cached[h] for h in want] == seq.block_table[:3]


def test_requests_with_different_salts_never_share_cached_blocks():
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(10))
    for salt in (None, "a", "b", ""):
        assert admit(bm, Seq(tokens=list(prompt), cache_salt=salt)) == 0, salt
    for salt in (None, "a", "b", ""):  # the same salt again: its own blocks come back
        again = Seq(tokens=list(prompt), cache_salt=salt)
        assert admit(bm, again) == 8, salt
    assert bm.num_used_blocks == 4 * 3 + 4  # each salt: three blocks, then its repeat's own last one


ops = st.lists(
    st.tuples(st.sampled_from(["new", "grow", "fork", "free", "reset"]), st.integers(0, 50),
              st.integers(1, 12), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([1, 2, 4]), st.integers(4, 30), st.booleans())
def test_invariants_hold_under_random_operations(operations, block_size, num_blocks, caching):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    seqs: list[Seq] = []
    contents: dict[int, list[int]] = {}  # block -> tokens written into it (by slot)
    salts: dict[int, str | None] = {}  # block -> the salt of the sequence that wrote it
    for op, pick, n, alphabet in operations:
        target = seqs[pick % len(seqs)] if seqs else None
        tokens = [(pick * 7 + i) % (alphabet + 1) for i in range(n)]  # small alphabet: many hits
        if op == "new":
            s = Seq(tokens=tokens, cache_salt="s" if pick % 3 == 0 else None)
            computed = bm.get_computed_blocks(s)
            cached = len(computed) * block_size
            free_before = bm.num_free_blocks
            if bm.allocate_slots(s, n - cached, computed) is None:
                assert s.block_table == [] and bm.num_free_blocks == free_before  # refused: nothing changed
            else:
                for i, block in enumerate(s.block_table[: cached // block_size]):
                    hit = s.tokens[i * block_size : (i + 1) * block_size]
                    assert contents[block] == hit, "a prefix-cache hit returned other tokens"
                    assert salts[block] == s.cache_salt, "a prefix-cache hit crossed salts"
                write(bm, s, cached, n, contents, salts)
                seqs.append(s)
        elif op == "grow" and target:
            target.tokens += tokens
            if bm.can_append(target, n):
                start = target.num_computed_tokens
                bm.append_slots(target, n)
                write(bm, target, start, start + n, contents, salts)
            else:
                del target.tokens[-n:]
        elif op == "fork" and target:
            child = Seq(tokens=list(target.tokens), cache_salt=target.cache_salt)
            bm.fork(target, child)
            seqs.append(child)
        elif op == "free" and target:
            bm.free(target)
            seqs.remove(target)
        elif op == "reset":  # preempt everything and lose the KV memory
            for s in seqs:
                bm.free(s)
            seqs.clear()
            bm.reset_cache()
        bm.check_invariants([s.block_table for s in seqs])
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == num_blocks


def write(bm: BlockManager, seq: Seq, start: int, end: int, contents: dict[int, list[int]],
          salts: dict[int, str | None]) -> None:
    """What the executor does: write tokens [start, end) into their slots."""
    for pos, slot in zip(range(start, end), bm.slot_mapping(seq, start, end - start), strict=True):
        block, offset = divmod(slot, bm.block_size)
        assert bm.ref_counts[block] == 1, "a shared block is written"
        salts[block] = seq.cache_salt
        row = contents.setdefault(block, [])
        del row[offset:]
        row.append(seq.tokens[pos])
    seq.num_computed_tokens = end
    bm.commit(seq, start, end)


def test_blocks_are_cached_only_once_their_kv_is_written():
    """Handing blocks out caches nothing: a step that fails leaves no block holding
    uncomputed KV under a prefix hash. `commit` (the step succeeded) caches them."""
    bm = BlockManager(num_blocks=8, block_size=4)
    failed = Seq(tokens=list(range(9)))
    assert bm.allocate_slots(failed, 9, []) == [0, 1, 2]
    assert cached_tokens(bm, Seq(tokens=list(range(9)))) == 0  # not while its step runs
    bm.free(failed)  # its step failed
    assert bm.num_cached_blocks == 0 and cached_tokens(bm, Seq(tokens=list(range(9)))) == 0
    bm.check_invariants([])

    done = Seq(tokens=list(range(9)))
    bm.allocate_slots(done, 5, bm.get_computed_blocks(done))  # a first chunk: one block completed
    bm.commit(done, 0, 5)
    assert cached_tokens(bm, Seq(tokens=list(range(9)))) == 4
    bm.append_slots(done, 4)  # the rest, whose step then fails: block 2 stays uncached
    bm.free(done)
    assert bm.num_cached_blocks == 1 and cached_tokens(bm, Seq(tokens=list(range(9)))) == 4
    bm.check_invariants([])
