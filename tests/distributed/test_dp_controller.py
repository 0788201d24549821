"""The data-parallel controller's routing: policies, load bookkeeping and the approximate prefix tree."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from labkit.distributed.dp_controller import (
    LOAD_BALANCE_POLICIES,
    ApproxPrefixTree,
    CacheAwarePolicy,
    DataParallelController,
    LoadBalancePolicy,
    ReplicaLoad,
    make_load_balance_policy,
    register_policy,
)

POLICY_NAMES = ["round_robin", "shortest_queue", "cache_aware"]


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Reference longest common prefix, independent of the module's helpers."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _best_lcp(prompt: Sequence[int], history: list[list[int]]) -> int:
    return max((_lcp(prompt, h) for h in history), default=0)


def _walk(tree: ApproxPrefixTree) -> int:
    """Check the tree's structure and return the tokens it holds."""
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        assert node is tree.root or node.key, "only the root has an empty key"
        for first, child in node.children.items():
            assert child.key[0] == first and child.parent is node
            assert child.last_access <= node.last_access or node is tree.root, "a parent is never older"
            stack.append(child)
        total += len(node.key)
    return total


def test_policy_registry_lists_the_three_policies_sorted():
    assert sorted(LOAD_BALANCE_POLICIES) == sorted(POLICY_NAMES)
    for name in POLICY_NAMES:
        policy = make_load_balance_policy(name, 3)
        assert isinstance(policy, LOAD_BALANCE_POLICIES[name]) and policy.name == name and policy.dp_size == 3


def test_unknown_policy_name_is_a_value_error_listing_the_known_names():
    msg = r"unknown load-balance policy 'nope'; choose one of \['cache_aware', 'round_robin', 'shortest_queue'\]"
    with pytest.raises(ValueError, match=msg):
        make_load_balance_policy("nope", 2)
    with pytest.raises(ValueError, match=msg):
        DataParallelController(2, "nope")


def test_registering_a_second_class_under_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'round_robin' is already registered"):

        @register_policy("round_robin")
        class Impostor(LoadBalancePolicy):
            def select(self, input_ids, loads):
                return 0

    assert LOAD_BALANCE_POLICIES["round_robin"].__name__ == "RoundRobinPolicy"


def test_dp_size_below_one_and_a_policy_built_for_another_dp_size_are_refused():
    with pytest.raises(ValueError, match="dp_size must be >= 1, got 0"):
        DataParallelController(0)
    with pytest.raises(ValueError, match="built for dp_size=3, controller has 2"):
        DataParallelController(2, CacheAwarePolicy(3))


def test_a_policy_choosing_an_out_of_range_replica_is_caught():
    class Broken(LoadBalancePolicy):  # not registered, so it has no name
        def select(self, input_ids, loads):
            return len(loads)

    c = DataParallelController(2, Broken(2))
    with pytest.raises(RuntimeError, match=r"Broken chose replica 2, not in \[0, 2\)"):
        c.route("a", [1])
    assert c.replica_of("a") is None and c.loads == [ReplicaLoad(), ReplicaLoad()]


def test_duplicate_rid_in_flight_is_a_value_error_and_changes_nothing():
    c = DataParallelController(2)
    assert c.route("a", [1, 2, 3]) == 0
    with pytest.raises(ValueError, match="request 'a' is already in flight on replica 0"):
        c.route("a", [4])
    assert c.loads == [ReplicaLoad(1, 3), ReplicaLoad(0, 0)] and c.routed_counts == [1, 0]
    c.finish("a")
    assert c.route("a", [4]) == 1  # a finished rid may be reused


def test_round_robin_cycles_through_replicas():
    c = DataParallelController(3, "round_robin")
    assert [c.route(f"r{i}", [i]) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert c.routed_counts == [3, 2, 2]


def test_select_is_a_pure_look_for_every_policy():
    for name in POLICY_NAMES:
        policy = make_load_balance_policy(name, 3)
        loads = [ReplicaLoad(2, 20), ReplicaLoad(1, 50), ReplicaLoad(1, 10)]
        first = policy.select([1, 2, 3], loads)
        assert all(policy.select([1, 2, 3], loads) == first for _ in range(5)), name
        assert loads == [ReplicaLoad(2, 20), ReplicaLoad(1, 50), ReplicaLoad(1, 10)], name


def test_shortest_queue_picks_the_least_loaded_and_finish_releases_its_load():
    c = DataParallelController(3, "shortest_queue")
    assert c.route("a", [0] * 10) == 0
    assert c.route("b", [0] * 5) == 1
    assert c.route("c", [0] * 1) == 2
    assert c.route("d", [0] * 3) == 2  # all at 1 in flight: fewest tokens wins
    assert c.loads == [ReplicaLoad(1, 10), ReplicaLoad(1, 5), ReplicaLoad(2, 4)]
    assert c.finish("a") == 0
    assert c.loads[0] == ReplicaLoad(0, 0)
    assert c.route("e", [0] * 100) == 0
    assert c.finish("e") == 0 and c.finish("b") == 1
    assert c.route("f", [0] * 7) == 0  # replicas 0 and 1 tie on (0, 0): lowest index wins


def test_finish_is_idempotent_and_unknown_rids_return_none():
    c = DataParallelController(2, "shortest_queue")
    assert c.finish("never-routed") is None
    c.route("a", [1, 2])
    assert c.replica_of("a") == 0
    assert c.finish("a") == 0
    assert c.finish("a") is None and c.replica_of("a") is None
    assert c.loads == [ReplicaLoad(), ReplicaLoad()] and c.routed_counts == [1, 0]


def test_loads_and_routed_counts_are_copies():
    c = DataParallelController(2)
    c.route("a", [1, 2])
    c.loads[0].in_flight = 99
    c.routed_counts[0] = 99
    assert c.loads[0] == ReplicaLoad(1, 2) and c.routed_counts == [1, 0]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_random_route_finish_sequences_keep_the_bookkeeping_consistent(policy, dp_size):
    rng = random.Random(f"{policy}-{dp_size}")
    c = DataParallelController(dp_size, policy)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    in_flight: dict[str, tuple[int, int]] = {}  # the reference: rid -> (replica, prompt tokens)
    finished: list[str] = []
    routes = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.5 or not in_flight:
            rid = f"r{step}" if op < 0.45 or not finished else rng.choice(finished)  # sometimes reuse a rid
            if rid in in_flight:
                continue
            prompt = rng.choice(prefixes)[: rng.randrange(41)] + [rng.randrange(1000) for _ in range(rng.randrange(8))]
            replica = c.route(rid, prompt)
            assert 0 <= replica < dp_size
            in_flight[rid] = (replica, len(prompt))
            routes += 1
        elif op < 0.85:
            rid = rng.choice(sorted(in_flight))
            assert c.finish(rid) == in_flight.pop(rid)[0]
            finished.append(rid)
        elif op < 0.93 and finished:
            rid = rng.choice(finished)
            if rid not in in_flight:
                assert c.finish(rid) is None  # already finished: nothing to release
        else:
            rid = rng.choice(sorted(in_flight))
            with pytest.raises(ValueError, match="already in flight"):
                c.route(rid, [1, 2, 3])
        loads = c.loads
        assert sum(load.in_flight for load in loads) == len(in_flight)
        for r in range(dp_size):
            mine = [tokens for rep, tokens in in_flight.values() if rep == r]
            assert loads[r] == ReplicaLoad(len(mine), sum(mine))
        assert sum(c.routed_counts) == routes
    for rid, (replica, _) in in_flight.items():
        assert c.replica_of(rid) == replica


def test_cache_aware_sends_requests_sharing_a_long_prefix_to_the_same_replica():
    c = DataParallelController(4, "cache_aware")
    shared = list(range(100))
    assert {c.route(f"s{i}", shared + [1000 + i]) for i in range(10)} == {0}
    assert c.route("other", list(range(5000, 5100))) == 1  # no match anywhere: shortest queue


def test_cache_aware_below_the_threshold_routes_by_shortest_queue():
    c = DataParallelController(2, "cache_aware")
    base = list(range(100))
    assert c.route("a", base) == 0
    assert c.route("low", base[:40] + list(range(1000, 1060))) == 1  # 40% matched < 0.5
    assert c.route("high", base[:60] + list(range(2000, 2040))) == 0  # 60% matched on replica 0


def test_cache_aware_ties_on_the_match_go_to_the_shorter_queue():
    policy = CacheAwarePolicy(3)
    for r in range(3):
        policy.on_routed(r, [7] * 50)
    loads = [ReplicaLoad(3, 30), ReplicaLoad(1, 90), ReplicaLoad(1, 10)]
    assert policy.select([7] * 50 + [8], loads) == 2


def test_balance_guard_overrides_cache_affinity_when_one_replica_is_overloaded():
    shared = list(range(200))
    c = DataParallelController(2, "cache_aware")
    assert [c.route(f"r{i}", shared + [1000 + i]) for i in range(33)] == [0] * 33
    # 33 vs 0 in flight: 33 - 0 > 32 and 33 > 1.5 x 0, so the cached replica is skipped
    assert c.route("r33", shared + [2000]) == 1
    unguarded = DataParallelController(2, CacheAwarePolicy(2, balance_abs_threshold=10**9))
    assert {unguarded.route(f"r{i}", shared + [1000 + i]) for i in range(40)} == {0}


def test_balance_guard_needs_both_the_absolute_and_the_relative_gap():
    policy = CacheAwarePolicy(2)

    def imbalanced(a: int, b: int) -> bool:
        return policy.is_imbalanced([ReplicaLoad(a), ReplicaLoad(b)])

    assert imbalanced(33, 0) and imbalanced(100, 60)
    assert not imbalanced(32, 0)  # the absolute gap is not over 32
    assert not imbalanced(200, 150)  # the gap is 50, but 200 <= 1.5 x 150


def test_prefix_tree_matches_exactly_what_was_inserted_when_nothing_is_evicted():
    rng = random.Random(1)
    tree = ApproxPrefixTree()
    bases = [[rng.randrange(50) for _ in range(30)] for _ in range(4)]
    inserted: list[list[int]] = []
    for _ in range(300):
        prompt = rng.choice(bases)[: rng.randrange(31)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
        query = rng.choice(bases)[: rng.randrange(31)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
        assert tree.match_prefix(query) == _best_lcp(query, inserted)
        tree.insert(prompt)
        inserted.append(prompt)
        assert tree.total_tokens == _walk(tree)


def test_prefix_tree_respects_max_tree_tokens_under_random_inserts():
    rng = random.Random(2)
    tree = ApproxPrefixTree(max_tokens=300)
    bases = [[rng.randrange(100) for _ in range(80)] for _ in range(5)]
    inserted: list[list[int]] = []
    for _ in range(2000):
        prompt = rng.choice(bases)[: rng.randrange(81)] + [rng.randrange(100) for _ in range(rng.randrange(40))]
        tree.insert(prompt)
        inserted.append(prompt)
        assert tree.total_tokens == _walk(tree) <= 300
        assert tree.match_prefix(prompt) == len(prompt)  # the newest prompt is the last to go
        query = rng.choice(inserted)
        assert tree.match_prefix(query) <= _best_lcp(query, inserted)  # never claims what was not inserted


def test_prefix_tree_evicts_least_recently_used_leaves_first_and_trims_an_oversized_prompt():
    tree = ApproxPrefixTree(max_tokens=30)
    a, b, c, d = ([k] * 10 for k in (1, 2, 3, 4))
    for prompt in (a, b, c):
        tree.insert(prompt)
    tree.insert(a)  # a is now more recent than b
    tree.insert(d)
    assert [tree.match_prefix(p) for p in (a, b, c, d)] == [10, 0, 10, 10]
    tree.insert(list(range(100, 150)))  # longer than the whole budget: only its head is kept
    assert tree.total_tokens == 30 and tree.match_prefix(list(range(100, 150))) == 30


def _shared_prefix_hit_fraction(policy: str, dp_size: int) -> tuple[float, list[int]]:
    """8 groups x 16 prompts (a 200-token group prefix + 20 unique tokens), shuffled, at most 8 in
    flight. Returns the fraction of prompt tokens already on the chosen replica before routing,
    measured against a reference: the longest common prefix with the prompts sent there earlier."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(32000) for _ in range(200)] for _ in range(8)]
    unique = iter(range(100_000, 10**9))
    prompts = [p + [next(unique) for _ in range(20)] for p in prefixes for _ in range(16)]
    rng.shuffle(prompts)
    c = DataParallelController(dp_size, policy)
    history: list[list[list[int]]] = [[] for _ in range(dp_size)]
    hit = 0
    in_flight: list[str] = []
    for i, prompt in enumerate(prompts):
        replica = c.route(f"r{i}", prompt)
        hit += _best_lcp(prompt, history[replica])
        history[replica].append(prompt)
        in_flight.append(f"r{i}")
        if len(in_flight) > 8:
            c.finish(in_flight.pop(rng.randrange(len(in_flight))))
    return hit / sum(len(p) for p in prompts), c.routed_counts


@pytest.mark.parametrize("dp_size", [2, 4])
def test_cache_aware_reuses_more_cached_prefix_than_round_robin_on_a_shared_prefix_workload(dp_size):
    cache_aware, counts = _shared_prefix_hit_fraction("cache_aware", dp_size)
    round_robin, _ = _shared_prefix_hit_fraction("round_robin", dp_size)
    best = (128 - 8) * 200 / (128 * 220)  # only each group's first prompt misses its prefix
    assert cache_aware == pytest.approx(best)
    assert cache_aware > round_robin + 0.05
    assert min(counts) >= 16  # affinity did not starve a replica: each got at least one whole group
