"""EngineRouter (data parallelism): prefix affinity, the load cap, liveness, ownership."""

from __future__ import annotations

import random

import pytest

from services.tokenizer.engine_router import LOAD_SLACK, EngineRouter, prefix_hashes
from shared.messages import EngineLoad, EngineLoads

ENGINES = ["engine-0", "engine-1"]


def prompt(system: int, user: int, block_size: int = 16) -> list[int]:
    """4 blocks of a shared system prompt, then a user part of its own."""
    return [1000 * system + i for i in range(4 * block_size)] + [50_000 + user, 7, 8]


def test_prefix_hashes_are_the_block_managers_chain():
    ids = list(range(40))
    hashes = prefix_hashes(ids, 16)
    assert len(hashes) == 2  # only full blocks
    assert hashes[0] == hash((None, tuple(range(16))))
    assert hashes[1] == hash((hashes[0], tuple(range(16, 32))))
    assert prefix_hashes(ids[:15], 16) == []


def test_requests_sharing_a_prefix_follow_it_and_different_prefixes_spread():
    router = EngineRouter(ENGINES, "prefix")
    first = {s: router.route(f"r{s}", prompt(s, 0)) for s in range(4)}
    assert sorted(first.values()) == ["engine-0", "engine-0", "engine-1", "engine-1"]  # least loaded in turn
    for i in range(20):
        s = i % 4
        assert router.route(f"q{i}", prompt(s, i + 1)) == first[s]
        router.check_invariants()
    assert router.prefix_routed == 20


def test_a_hot_prefix_is_capped_and_spreads():
    router = EngineRouter(ENGINES, "prefix")
    got = [router.route(f"r{i}", prompt(0, i)) for i in range(60)]
    router.check_invariants()
    share = got.count("engine-0") / len(got)
    assert 0.3 <= share <= 0.7, share
    # the busier engine loses the preference only beyond the cap
    loads = [router.load(e) for e in ENGINES]
    assert max(loads) <= 1.5 * min(loads) + LOAD_SLACK + 1


def test_release_and_reported_load_steer_new_requests():
    router = EngineRouter(ENGINES, "least-loaded")
    for i in range(6):
        router.route(f"a{i}", [i])
    assert router.load("engine-0") == router.load("engine-1") == 3
    for rid in [r for r in router.owned() if router.owner(r) == "engine-1"]:
        router.release(rid)
    router.check_invariants()
    assert router.route("b", [1]) == "engine-1"
    # the gateway reports engine-1 busy (other replicas' work) and its KV nearly full
    router.update(EngineLoads([EngineLoad("engine-0", 2, 1, 0.1), EngineLoad("engine-1", 10, 5, 0.9)]))
    assert [router.route(f"c{i}", [i]) for i in range(3)] == ["engine-0"] * 3
    router.check_invariants()


def test_only_live_engines_get_requests_and_owners_stay():
    router = EngineRouter(["engine-0", "engine-1", "engine-2"], "prefix")
    owner = router.route("x", prompt(1, 0))
    router.update(EngineLoads([EngineLoad(e) for e in ("engine-0", "engine-1", "engine-2") if e != owner]))
    again = router.route("y", prompt(1, 1))
    assert again != owner  # the prefix's engine is gone: routed around
    assert router.owner("x") == owner  # a request keeps its engine for its later messages
    assert router.route("z", prompt(1, 2)) == again  # the prefix now lives where it went
    router.update(EngineLoads([EngineLoad("engine-9")]))  # unknown engines are ignored...
    assert router.route("w", [1]) in router.engines  # ...and with none live, any configured one
    router.check_invariants()


def test_round_robin_takes_turns():
    router = EngineRouter(ENGINES, "round-robin")
    assert [router.route(f"r{i}", prompt(0, i)) for i in range(4)] == ["engine-0", "engine-1"] * 2


def test_the_prefix_map_is_bounded():
    router = EngineRouter(ENGINES, "prefix", max_prefixes=10)
    rng = random.Random(0)
    for i in range(50):
        router.route(f"r{i}", [rng.randrange(1000) for _ in range(64)])
        router.release(f"r{i}")
        router.check_invariants()
    assert router.owned() == []


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        EngineRouter([], "prefix")
    with pytest.raises(ValueError, match="routing policy"):
        EngineRouter(ENGINES, "random")
