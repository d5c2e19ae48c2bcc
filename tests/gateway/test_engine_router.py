"""EngineRouter (data parallelism): prefix affinity, the load cap, warming and held requests,
liveness, ownership; check_invariants under random operations (hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.engine_router import (
    HOLD_MAX_S,
    LOAD_RATIO,
    LOAD_SLACK,
    EngineLoad,
    EngineLoads,
    EngineRouter,
    prefix_hashes,
)
from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import Sequence
from shared.messages import SamplingParams

ENGINES = ["engine-0", "engine-1"]


def prompt(system: int, user: int, block_size: int = 16) -> list[int]:
    """4 blocks of a shared system prompt, then a user part of its own."""
    return [1000 * system + i for i in range(4 * block_size)] + [50_000 + user, 7, 8]


def test_prefix_hashes_are_the_block_managers_chain():
    ids = list(range(40))
    for salt in (None, "tenant"):
        hashes = prefix_hashes(ids, 16, salt)
        assert len(hashes) == 2  # only full blocks
        req = Sequence("r", ids, SamplingParams(cache_salt=salt), frozenset(), 0.0)
        bm = BlockManager(8, 16)
        bm.allocate_slots(req, 40, [])
        req.num_computed_tokens = 40
        bm.commit(req, 0, 40)
        assert req.block_hashes == hashes
    assert prefix_hashes(ids, 16, "tenant") != prefix_hashes(ids, 16)
    assert prefix_hashes(ids[:15], 16) == []


def test_a_salted_prompt_does_not_follow_the_same_unsalted_prefix():
    """Blocks of different salts are never shared by the engines, so a salted prompt is not
    routed (or held) for the sake of another salt's copy of its prefix."""
    router = EngineRouter(ENGINES, "prefix")
    first = router.route("a", prompt(1, 0))
    router.prefilled("a")
    assert router.route("b", prompt(1, 1), cache_salt="tenant") != first  # least loaded, not the holder
    assert router.route("c", prompt(1, 2), cache_salt="tenant") != first  # follows its own salt's copy
    assert not router.held("b")
    router.check_invariants()


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
    assert max(loads) <= LOAD_RATIO * min(loads) + LOAD_SLACK + 1


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


class Engines:
    """The router's tokenizer replica and its engines' prefix caches, as far as routing sees
    them: a request sent goes into its engine's next step; after the step its blocks are
    cached there (prefilled), and it finds cached only what an earlier step left."""

    def __init__(self, router: EngineRouter):
        self.router = router
        self.cached: dict[str, set[int]] = {e: set() for e in router.engines}
        self.step: list[tuple[str, list[int]]] = []  # sent, not yet prefilled
        self.held: dict[str, list[int]] = {}
        self.queries = self.hits = 0

    def send(self, rid: str, ids: list[int]) -> str:
        engine = self.router.route(rid, ids)
        if self.router.held(rid):
            self.held[rid] = ids
        else:
            self.step.append((rid, ids))
        return engine

    def run_step(self) -> None:
        """The engines prefill what was sent; the held requests it frees are sent."""
        for rid, ids in self.step:
            cache = self.cached[self.router.owner(rid)]
            hashes = prefix_hashes(ids, self.router.block_size)
            self.queries += len(hashes)
            self.hits += next((i for i, h in enumerate(hashes) if h not in cache), len(hashes))
        for rid, ids in self.step:
            self.cached[self.router.owner(rid)].update(prefix_hashes(ids, self.router.block_size))
            self.router.prefilled(rid)
        self.step = [(rid, self.held.pop(rid)) for rid in self.router.ready()]
        self.router.check_invariants()


def test_the_dp_tests_workload_keeps_each_system_prompt_on_one_engine():
    """tests/e2e/test_data_parallel.py's waves: 4 system prompts, then 60 requests in a
    shuffled burst: no spill, no hold, every system prompt on one engine, even split."""
    for seed in range(20):
        router = EngineRouter(ENGINES, "prefix")
        engines = Engines(router)
        for s in range(4):
            engines.send(f"w{s}", prompt(s, 0))
        engines.run_step()
        home = {s: {router.owner(f"w{s}")} for s in range(4)}
        assert sorted(min(h) for h in home.values()) == ["engine-0"] * 2 + ["engine-1"] * 2
        for s in range(4):
            router.release(f"w{s}")
        burst = [(f"r{i}", prompt(i % 4, i)) for i in range(4, 64)]
        random.Random(seed).shuffle(burst)
        got = [engines.send(rid, ids) for rid, ids in burst]
        engines.run_step()
        assert router.spilled == 0 and router.held_total == 0
        assert engines.hits == engines.queries - 4 * 4  # only the first wave's 4 blocks each missed
        assert got.count("engine-0") == 30, got
        assert {s: {router.owner(f"r{i}") for i in range(4, 64) if i % 4 == s} for s in range(4)} == home


def test_a_cold_hot_prefix_spills_once_per_engine_and_the_rest_wait_for_its_prefill():
    router = EngineRouter(ENGINES, "prefix")
    engines = Engines(router)
    got = [engines.send(f"r{i}", prompt(0, i)) for i in range(40)]
    assert 0.3 <= got.count("engine-0") / 40 <= 0.7, got
    assert router.spilled >= 1
    assert len(engines.step) == 2 and {router.owner(rid) for rid, _ in engines.step} == set(ENGINES)
    assert router.held_total == 38
    engines.run_step()  # the two first prefills: all cold
    assert engines.hits == 0 and len(engines.step) == 38
    engines.run_step()  # the rest find the system prompt cached on their engine
    assert engines.hits == 38 * 4 and engines.queries == 40 * 4


def test_a_prefix_on_two_engines_goes_to_the_less_loaded_holder():
    router = EngineRouter(ENGINES, "prefix")
    engines = Engines(router)
    for i in range(30):  # enough to spill: both engines hold system prompt 0 now
        engines.send(f"a{i}", prompt(0, i))
    engines.run_step()
    engines.run_step()
    for rid in [r for r in router.owned() if router.owner(r) == "engine-1"]:
        router.release(rid)
    spilled = router.spilled
    assert engines.send("b", prompt(0, 99)) == "engine-1"
    assert router.spilled == spilled and not router.held("b")  # a holder: no spill, and warm there


def test_a_held_request_goes_when_its_warmer_is_released_or_its_engine_is_lost_or_late():
    now = [0.0]
    router = EngineRouter(ENGINES, "prefix", clock=lambda: now[0])
    engine = router.route("first", prompt(3, 0))
    router.route("second", prompt(3, 1))
    router.route("third", prompt(3, 2))
    assert router.held("second") and router.held("third") and router.ready() == []
    router.release("first")  # aborted before its prefill: its engine may not hold the prefix
    assert router.ready() == ["second"]  # the second warms it now; the third waits for it
    assert router.held("third")
    router.check_invariants()
    router.update(EngineLoads([EngineLoad(e) for e in ENGINES if e != engine]))
    assert router.ready() == ["third"]  # sent to a lost engine: the gateway sends it again
    router.update(EngineLoads([EngineLoad(e) for e in ENGINES]))
    router.route("fourth", prompt(3, 3))  # the lost engine's blocks were forgotten: this one warms them
    router.route("fifth", prompt(3, 4))
    assert not router.held("fourth") and router.held("fifth")
    now[0] += HOLD_MAX_S
    assert router.ready() == ["fifth"]
    router.check_invariants()


def test_a_longer_prompt_waits_for_the_shared_part_and_warms_its_own():
    router = EngineRouter(ENGINES, "prefix")
    short = prompt(5, 0)
    engine = router.route("short", short)
    longer = short[:64] + list(range(900, 964))  # the 4 shared blocks, then 4 of its own
    assert router.route("long", longer) == engine and router.held("long")
    assert router.route("longer-still", longer + [1, 2]) == engine and router.held("longer-still")
    router.prefilled("short")
    assert router.ready() == ["long"]  # "longer-still" waits for the blocks "long" warms
    router.prefilled("long")
    assert router.ready() == ["longer-still"]
    router.check_invariants()


def loads(engines=ENGINES, instances=None):
    return EngineLoads([EngineLoad(e, instance=(instances or {}).get(e, f"{e}-A")) for e in engines])


def test_a_restarted_engine_is_forgotten_so_a_burst_on_its_prefix_waits_for_one_cold_prefill():
    router = EngineRouter(ENGINES, "prefix")
    engines = Engines(router)
    router.update(loads())
    for s in range(2):
        engines.send(f"w{s}", prompt(s, 0))
    engines.run_step()
    home = router.owner("w0")
    other = router.owner("w1")
    assert home != other
    for s in range(2):
        router.release(f"w{s}")
    router.update(loads())  # the same instances: nothing forgotten
    assert router.forgotten == 0
    router.update(loads(instances={home: f"{home}-B"}))  # its scheduler restarted: an empty cache
    engines.cached[home].clear()
    assert router.forgotten == 1
    router.check_invariants()
    routed, hits = router.prefix_routed, engines.hits
    for i in range(4):
        engines.send(f"b{i}", prompt(0, i + 1))
    # one request warms system prompt 0 again (on the emptier engine); the others wait for it
    # instead of all missing the cache in the same step, as they would on a stale map
    assert router.prefix_routed - routed == 3 and len(engines.step) == 1 and router.held_total == 3
    engines.run_step()
    engines.run_step()
    assert engines.hits - hits == 3 * 4
    router.update(loads(instances={home: f"{home}-B"}))  # still B: nothing more to forget
    assert router.forgotten == 1
    router.check_invariants()


def test_the_first_report_of_an_instance_keeps_what_was_routed_before_it():
    router = EngineRouter(ENGINES, "prefix")
    engine = router.route("a", prompt(1, 0))
    router.prefilled("a")
    router.update(EngineLoads([EngineLoad(e) for e in ENGINES]))  # an older gateway: no instance
    router.update(loads())  # the first instance named: no change to compare with
    assert router.route("b", prompt(1, 1)) == engine and router.prefix_routed == 1 and router.forgotten == 0


def test_a_restart_stops_the_warming_of_its_requests_and_lets_those_held_behind_them_go():
    router = EngineRouter(ENGINES, "prefix")
    router.update(loads())
    engine = router.route("warm", prompt(2, 0))
    assert router.route("behind", prompt(2, 1)) == engine and router.held("behind")
    bystander = next(e for e in ENGINES if e != engine)
    router.route("elsewhere", prompt(7, 0))  # the emptier engine warms another prefix
    assert router.owner("elsewhere") == bystander
    router.update(loads(instances={engine: f"{engine}-B"}))
    assert router.ready() == ["behind"]  # sent now; the gateway sends both again anyway
    assert router.owner("warm") == engine  # still its owner until the gateway's abort releases it
    router.check_invariants()
    router.prefilled("warm")  # a late first output of the old instance: not a cached block any more
    router.release("warm")
    router.release("behind")
    assert router.route("again", prompt(2, 2)) is not None and not router.held("again")
    assert router.prefix_routed == 1  # only "behind": the bystander's prefix map was left alone
    assert router.route("elsewhere-2", prompt(7, 1)) == bystander and router.prefix_routed == 2
    router.check_invariants()


def test_an_engine_that_leaves_the_live_set_is_forgotten_even_if_it_comes_back_unchanged():
    router = EngineRouter(ENGINES, "prefix")
    router.update(loads())
    engine = router.route("a", prompt(4, 0))
    router.prefilled("a")
    router.release("a")
    router.update(loads([e for e in ENGINES if e != engine]))
    router.check_invariants()
    router.update(loads())  # back, same instance: it may have reset its cache (executor restart)
    router.route("b", prompt(4, 1))
    assert router.prefix_routed == 0 and router.forgotten == 1


ops = st.lists(st.tuples(st.sampled_from(["route", "prefilled", "release", "update", "restart", "tick"]),
                         st.integers(0, 5), st.integers(0, 3)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from(["prefix", "least-loaded", "round-robin"]), st.integers(2, 40))
def test_invariants_hold_under_random_operations(ops, policy, max_prefixes):
    now = [0.0]
    engines = ["engine-0", "engine-1", "engine-2"]
    router = EngineRouter(engines, policy, block_size=4, max_prefixes=max_prefixes, clock=lambda: now[0])
    sent: set[str] = set()
    instances = dict.fromkeys(engines, 0)
    n = 0
    for op, a, b in ops:
        if op == "route":
            n += 1
            rid = f"r{n}"
            engine = router.route(rid, [1000 * b + k for k in range(4 * a)] + [n])
            assert engine in (router.live or engines)
            if not router.held(rid):
                sent.add(rid)
        elif op == "prefilled" and sent:
            router.prefilled(sorted(sent)[a % len(sent)])
        elif op == "release" and router.owned():
            rid = router.owned()[a % len(router.owned())]
            router.release(rid)
            sent.discard(rid)
        elif op in ("update", "restart"):
            if op == "restart":
                instances[engines[b % 3]] += 1
            router.update(EngineLoads([EngineLoad(e, a, b, a / 10, instance=f"{e}-{instances[e]}")
                                       for i, e in enumerate(engines) if i != b or op == "restart"]))
        elif op == "tick":
            now[0] += a
        for rid in router.ready():
            assert rid in router.owned() and not router.held(rid)
            sent.add(rid)
        router.check_invariants()
    assert all(router.held(rid) for rid in router.owned() if rid not in sent)


def test_a_report_that_still_counts_requests_that_just_ended_adds_no_load():
    """Heartbeats lag: a report made before this gateway's requests ended still counts them,
    which must not read as another gateway's load (a cold burst would then not spill)."""
    now = [0.0]
    router = EngineRouter(ENGINES, "least-loaded", clock=lambda: now[0])
    for i in range(20):
        router.route(f"a{i}", [i])
    for rid in list(router.owned()):
        router.release(rid)
    now[0] = 0.2
    router.update(EngineLoads([EngineLoad("engine-0", 10, 0), EngineLoad("engine-1", 10, 0)]))  # before they ended
    assert router.load("engine-0") == router.load("engine-1") == 0
    now[0] = 1.0  # a later report counting the same 10 requests is someone else's work
    router.update(EngineLoads([EngineLoad("engine-0", 10, 0), EngineLoad("engine-1", 0, 0)]))
    assert router.load("engine-0") == 10 and router.route("b", [1]) == "engine-1"
    router.check_invariants()
