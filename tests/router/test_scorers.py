"""Each scorer and the filter alone, and the weighted pick against a brute-force oracle."""
from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.keys import block_hashes
from router.routing.policy import POLICIES, Policy, Weighted, make_policy
from router.routing.scorers import (
    BoundedLoadFilter,
    HashRing,
    InverseLoadScorer,
    PrefillCostScorer,
    RingScorer,
    RotationScorer,
    fair_share,
    load_cap,
    route_key,
)
from router.routing.types import RouteRequest, RoutingPolicy, RoutingState, WorkerId, WorkerInfo, WorkerLoad

SALT = b"scorer-salt"
SCORERS = [InverseLoadScorer(), RingScorer(), RotationScorer(), PrefillCostScorer()]


def _workers(n: int) -> list[WorkerInfo]:
    return [WorkerInfo(WorkerId(f"w{i}"), f"127.0.0.1:{7000 + i}") for i in range(n)]


def _route(seed: int, blocks: int = 5) -> RouteRequest:
    ids = tuple(seed * 1000 + i for i in range(blocks * 16 + 3))
    return RouteRequest(ids, tuple(block_hashes(ids, 16, SALT)))


states = st.builds(
    lambda n, loads, cached: (n, RoutingState(
        {WorkerId(f"w{i}"): WorkerLoad(*ld) for i, ld in enumerate(loads[:n])},
        {WorkerId(f"w{i}"): c for i, c in enumerate(cached[:n])})),
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 100), st.integers(0, 100)), max_size=8),
    st.lists(st.integers(0, 10), max_size=8))


@settings(max_examples=80, deadline=None)
@given(data=states, seed=st.integers(0, 50))
def test_every_scorer_scores_every_worker_in_0_1_and_never_raises_on_missing_data(data, seed):
    n, state = data   # loads / cached lists may be shorter than n: those workers have no data
    workers = _workers(n)
    for scorer in SCORERS:
        scores = scorer.score(workers, _route(seed), state)
        assert set(scores) == {w.worker_id for w in workers}, scorer
        assert all(0.0 <= s <= 1.0 for s in scores.values()), (scorer, scores)


def test_inverse_load_is_one_over_one_plus_in_flight():
    workers = _workers(3)
    loads = {"w0": WorkerLoad(0, 0, 100), "w1": WorkerLoad(3, 5, 100), "w2": WorkerLoad(1, 60, 100)}
    state = RoutingState(loads)
    assert InverseLoadScorer().score(workers, _route(0), state) == {"w0": 1.0, "w1": 0.25, "w2": 0.5}
    assert InverseLoadScorer().score(workers, _route(0), RoutingState()) == {"w0": 1.0, "w1": 1.0, "w2": 1.0}


def test_ring_scorer_follows_the_ring_clockwise_from_the_key():
    workers, route = _workers(5), _route(7)
    # Oracle: the ring built by hand, walked from the key of the first 4 blocks.
    points = sorted((int.from_bytes(hashlib.blake2b(f"{w.worker_id}#{v}".encode(), digest_size=8).digest(), "big"),
                     w.worker_id) for w in workers for v in range(64))
    key = route_key(route, 4)
    order: list[str] = []
    for _, owner in [p for p in points if p[0] >= key] + [p for p in points if p[0] < key]:
        if owner not in order:
            order.append(owner)
    scores = RingScorer().score(workers, route, RoutingState())
    assert sorted(scores, key=lambda w: -scores[w]) == order
    assert scores[order[0]] == 1.0 and scores[order[-1]] == pytest.approx(1 / 5)
    assert HashRing().walk(list(reversed(workers)), key) == order       # worker order does not matter


def test_rotation_scorer_turns_one_step_per_call():
    workers, rot = _workers(3), RotationScorer()
    tops = [max((s := rot.score(workers, _route(0), RoutingState())), key=s.__getitem__) for _ in range(6)]
    assert tops == ["w0", "w1", "w2"] * 2


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), c=st.sampled_from([1.0, 1.25, 2.0]), loads=st.lists(st.integers(0, 12), min_size=8))
def test_bounded_load_filter_keeps_exactly_the_workers_under_the_cap(n, c, loads):
    workers = _workers(n)
    state = RoutingState({w.worker_id: WorkerLoad(loads[i]) for i, w in enumerate(workers)})
    cap = math.ceil(c * (sum(loads[:n]) + 1) / n)
    kept = BoundedLoadFilter(c).keep(workers, _route(0), state)
    under = [w for i, w in enumerate(workers) if loads[i] < cap]
    assert kept == (under or workers)
    assert under, "with c >= 1 someone is always under the cap"


def test_bad_parameters_are_value_errors():
    for make in (lambda: BoundedLoadFilter(0.9),
                 lambda: RingScorer(num_prefix_blocks=0), lambda: Weighted(InverseLoadScorer(), -1.0),
                 lambda: make_policy("fastest"), lambda: make_policy(RoutingPolicy.KV_AWARE, 0.5),
                 lambda: PrefillCostScorer(running_cost_tokens=-1.0), lambda: PrefillCostScorer(prefill_weight=0.5),
                 lambda: PrefillCostScorer(sustained_cost_tokens=-1.0),
                 lambda: BoundedLoadFilter(1.25, holder_factor=0.5)):
        with pytest.raises(ValueError):
            make()


@settings(max_examples=80, deadline=None)
@given(data=states, seed=st.integers(0, 50), w=st.tuples(*[st.sampled_from([0.0, 0.3, 1.0])] * 3),
       exclude=st.sets(st.integers(0, 7), max_size=3))
def test_weighted_pick_matches_brute_force(data, seed, w, exclude):
    """Oracle: total every weighted scorer by hand over the pool, keep the filtered workers,
    take the highest (rounded) total, ties to the higher tie-break score."""
    n, state = data
    workers, route = _workers(n), _route(seed)
    excluded = {WorkerId(f"w{i}") for i in exclude}
    scorers = (PrefillCostScorer(), InverseLoadScorer(), RingScorer(num_prefix_blocks=1))
    policy = Policy(RoutingPolicy.KV_AWARE, tuple(Weighted(s, x) for s, x in zip(scorers, w)),
                    (BoundedLoadFilter(1.25),), tiebreak=RingScorer())
    chosen = policy.pick(workers, route, state, exclude=excluded)
    pool = [x for x in workers if x.worker_id not in excluded]
    if not pool:
        assert chosen is None
        return
    totals = {x.worker_id: 0.0 for x in pool}
    for s, weight in zip(scorers, w):
        for wid, v in s.score(pool, route, state).items():
            totals[wid] += weight * v
    ring = RingScorer().score(pool, route, state)
    eligible = BoundedLoadFilter(1.25).keep(pool, route, state)
    best = max(eligible, key=lambda x: (round(totals[x.worker_id], 9), ring[x.worker_id]))
    assert chosen == best


def test_registry_has_every_policy_and_fresh_state_per_make():
    assert set(POLICIES) == set(RoutingPolicy)
    assert {p.value for p in RoutingPolicy} == {"kv_aware", "prefix_hash", "least_loaded", "round_robin"}
    for p in RoutingPolicy:
        assert make_policy(p).name is p and make_policy(p.value).name is p
    a, b = make_policy(RoutingPolicy.ROUND_ROBIN), make_policy(RoutingPolicy.ROUND_ROBIN)
    workers = _workers(3)
    assert a.pick(workers, _route(0), RoutingState()) == b.pick(workers, _route(0), RoutingState())


def test_router_config_takes_the_cli_spelling_and_stores_the_member():
    from router.config import RouterConfig
    assert RouterConfig(routing_policy="prefix_hash").routing_policy is RoutingPolicy.PREFIX_HASH
    assert RouterConfig().routing_policy is RoutingPolicy.KV_AWARE
    with pytest.raises(ValueError, match="routing_policy='fastest'; accepted: kv_aware, prefix_hash"):
        RouterConfig(routing_policy="fastest")


@pytest.mark.multiproc
def test_router_core_and_fronts_import_no_torch():
    import subprocess
    import sys
    code = ("import sys, router.routing.core, router.workers.registry, router.fronts.grpc_front, "
            "router.fronts.openai.app, router.server, "
            "router.routing.policy, router.routing.scorers; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_prefill_cost_adds_its_terms():
    """cost = β(L − bs·(cached + fetched) + φ·bs·fetched + u·(L − bs·cached)) + γ·queued
    + κ·in_flight + κ̄·mean_in_flight, each term alone."""
    route = _route(3, blocks=5)                     # 83 tokens, 5 full blocks
    L = len(route.token_ids)
    scorer = PrefillCostScorer(running_cost_tokens=16.0, prefill_weight=2.0, sustained_cost_tokens=512.0,
                               fetch_cost_ratio=0.1, room_frac=0.4)
    w = WorkerId("w0")
    assert scorer.cost(w, route, RoutingState()) == 2.0 * L
    assert scorer.cost(w, route, RoutingState(cached_blocks={w: 3})) == 2.0 * (L - 48)
    assert scorer.cost(w, route, RoutingState(cached_blocks={w: 9})) == 0.0          # capped at L
    assert scorer.cost(w, route, RoutingState(queued_tokens={w: 100})) == 2.0 * L + 2.0 * 100
    assert scorer.cost(w, route, RoutingState({w: WorkerLoad(3)})) == 2.0 * L + 48
    assert scorer.cost(w, route, RoutingState(mean_in_flight={w: 0.5})) == 2.0 * L + 256
    # 4 blocks a peer stored: fetched at φ = 0.1 of their prefill; beyond L they do not count
    assert scorer.cost(w, route, RoutingState(fetchable_blocks={w: 4})) == pytest.approx(2.0 * (L - 64 + 6.4))
    assert scorer.cost(w, route, RoutingState(cached_blocks={w: 3}, fetchable_blocks={w: 9})) \
        == pytest.approx(2.0 * 0.1 * (L - 48))
    # shared prefixes fill 3/4 of the pool: each new token displaces one with u = (0.75 − 0.4) / 0.6,
    # which a later request recomputes, displacing again: u + u² + … = u / (1 − u) = 1.4 per token
    committed = RoutingState({w: WorkerLoad(0, free_blocks=10, num_blocks=40, shared_blocks=30)}, {w: 3})
    assert scorer.cost(w, route, committed) == pytest.approx(2.0 * (L - 48) * 2.4)
    roomy = RoutingState({w: WorkerLoad(0, free_blocks=10, num_blocks=40, shared_blocks=16)}, {w: 3})
    assert scorer.cost(w, route, roomy) == 2.0 * (L - 48)                # at most room_frac: no displacement
    full = RoutingState({w: WorkerLoad(0, free_blocks=0, num_blocks=40, shared_blocks=40)}, {w: 3})
    assert scorer.cost(w, route, full) == pytest.approx(2.0 * (L - 48) * 10)   # u capped at 0.9: 9 per token
    # the default room is 20%: the same 3/4 displaces with u = (0.75 − 0.2) / 0.8, 2.2 per token
    assert PrefillCostScorer().room_frac == 0.2
    assert PrefillCostScorer().cost(w, route, committed) == pytest.approx(2.0 * (L - 48) * (1 + 0.6875 / 0.3125))
    assert WorkerLoad(0, num_blocks=0, shared_blocks=5).committed == 0.0     # no report: no data
    # the router's expected (fading) shared blocks count; the worker's reused count, which never
    # fades, does not: a pool of blocks reused long ago is room
    assert WorkerLoad(0, num_blocks=40, reused_blocks=8, shared_blocks=30.0).committed == 0.75
    assert WorkerLoad(0, num_blocks=40, reused_blocks=38, shared_blocks=4.0).committed == 0.1


def test_a_prefix_held_on_disk_only_costs_its_measured_read():
    """Leading blocks a worker holds on disk only cost ψ = its disk_read_cost of their prefill:
    the holder still wins over recomputing while ψ < 1, and loses to a worker holding the prefix
    in memory; unmeasured (ψ = 0) they count as any hit."""
    route = _route(3, blocks=5)                     # 83 tokens
    L = len(route.token_ids)
    scorer = PrefillCostScorer(running_cost_tokens=0.0)
    a, b, c = WorkerId("a"), WorkerId("b"), WorkerId("c")
    loads = {a: WorkerLoad(0, disk_read_cost=0.25), b: WorkerLoad(0, disk_read_cost=0.25), c: WorkerLoad(0)}
    state = RoutingState(loads, {a: 4, b: 4}, disk_blocks={a: 3, b: 0})
    assert scorer.cost(a, route, state) == pytest.approx(2.0 * (L - 64 + 0.25 * 48))
    assert scorer.cost(b, route, state) == 2.0 * (L - 64)                         # all in memory
    assert scorer.cost(c, route, state) == 2.0 * L
    assert scorer.cost(a, route, state) < scorer.cost(c, route, state)            # the read beats recomputing
    unmeasured = RoutingState({a: WorkerLoad(0)}, {a: 4}, disk_blocks={a: 3})
    assert scorer.cost(a, route, unmeasured) == 2.0 * (L - 64)
    slow = RoutingState({a: WorkerLoad(0, disk_read_cost=1.5)}, {a: 4}, disk_blocks={a: 4})
    assert scorer.cost(a, route, slow) > scorer.cost(c, route, state)             # slower than computing it
    picked = make_policy("kv_aware").pick(_workers(3), route, RoutingState(
        {WorkerId("w0"): WorkerLoad(0, disk_read_cost=0.5), WorkerId("w1"): WorkerLoad(0)},
        {WorkerId("w0"): 5, WorkerId("w1"): 5}, disk_blocks={WorkerId("w0"): 5}))
    assert picked is not None and picked.worker_id == "w1"                        # memory over disk


def test_a_copy_of_a_prefix_held_elsewhere_displaces_at_the_cluster_fill():
    """Blocks another worker holds are a second copy on w: they displace at the larger of
    w's u and the cascade of the cluster's (past `copy_room_frac`), while w's own new blocks
    displace only past w's room; a new prefix (held nowhere) is priced by w alone."""
    route = _route(3, blocks=5)                     # 83 tokens, 5 full blocks
    L = len(route.token_ids)
    scorer = PrefillCostScorer(fetch_cost_ratio=0.1, room_frac=0.0, copy_room_frac=0.0)
    w, v = WorkerId("w0"), WorkerId("w1")
    roomy = {w: WorkerLoad(0, 10, 40, 0)}
    held_by_v = RoutingState(roomy, {w: 0, v: 5}, cluster_committed=0.5)      # u' = 0.5 / 0.5 = 1
    assert scorer.cost(w, route, held_by_v) == pytest.approx(2.0 * (L + 1.0 * 80))
    # fetched from v instead of computed: φ of the prefill, the copy still displaces
    fetch = RoutingState(roomy, {w: 0, v: 5}, fetchable_blocks={w: 5}, cluster_committed=0.5)
    assert scorer.cost(w, route, fetch) == pytest.approx(2.0 * (L - 80 + 0.1 * 80 + 80))
    assert scorer.cost(w, route, RoutingState(roomy, {w: 0}, cluster_committed=0.5)) == 2.0 * L
    # the default: a copy has w's own 20% room (copy_room_frac 0.2), so a cluster its prompts
    # fill at most a fifth of charges nothing for it, a 60% full one p / (1 − p) = 1
    default = PrefillCostScorer(fetch_cost_ratio=0.1)
    assert (default.room_frac, default.copy_room_frac) == (0.2, 0.2)
    assert default.cost(w, route, RoutingState(roomy, {w: 0, v: 5}, cluster_committed=0.0)) == 2.0 * L
    assert default.cost(w, route, RoutingState(roomy, {w: 0, v: 5}, cluster_committed=0.2)) == 2.0 * L
    assert default.cost(w, route, RoutingState(roomy, {w: 0, v: 5}, cluster_committed=0.6)) == pytest.approx(
        2.0 * (L + 1.0 * 80))                       # p = 0.4 / 0.8, u' = 1
    assert PrefillCostScorer(copy_room_frac=0.0).cost(
        w, route, RoutingState(roomy, {w: 0, v: 5}, cluster_committed=0.2)) == pytest.approx(2.0 * (L + 0.25 * 80))


def test_a_fetched_replica_for_a_moment_of_load_waits_once_the_cluster_fills():
    """The pick of `kvmesh bench routing-live --quick`'s pressure run (14:07 UTC) that replicated a
    prefix: its holder w1 ran 5 requests, w0 none, the prefix stored on w1 (w0 could fetch it),
    the pools 112 blocks and ~60% full, the cluster's shared prefixes a quarter of them by the
    index's estimate then (8 of the 12 prefixes seen, 6 asked once). Priced at that R past a 0.2
    room the copy cost u' = 0.07 and w0 fetched it; its 16 blocks were the pools' last slack.
    `cluster_fill` counts those prompts' blocks in full: 0.47 in a traced run of the scenario
    (23:16 UTC) once 8 prefixes were stored, and at that R the pick waits on the holder, from the
    0.2 room or from 0; in a nearly empty cluster the fetch is still taken."""
    ids = tuple(range(1000, 1288))                  # 256 prefix tokens + 32 of a question
    route = RouteRequest(ids, tuple(block_hashes(ids, 16, SALT)))
    workers = _workers(2)
    state = RoutingState({"w0": WorkerLoad(0, 0, 112, shared_blocks=17.6),
                          "w1": WorkerLoad(5, 0, 112, shared_blocks=37.6)},
                         cached_blocks={"w1": 16}, queued_tokens={"w1": 32}, block_size=16,
                         mean_in_flight={"w0": 0.49, "w1": 0.77}, fetchable_blocks={"w0": 16},
                         cluster_committed=0.47)
    policy = make_policy("kv_aware")
    assert policy.pick(workers, route, state).worker_id == "w1"
    from_zero = Policy(policy.name, (Weighted(PrefillCostScorer(copy_room_frac=0.0), 1.0),), policy.filters,
                       policy.tiebreak)
    assert from_zero.pick(workers, route, state).worker_id == "w1"
    old_r = RoutingState(state.loads, state.cached_blocks, state.queued_tokens, 16, state.mean_in_flight,
                         state.fetchable_blocks, cluster_committed=0.25)
    assert policy.pick(workers, route, old_r).worker_id == "w0"     # the old estimate's R: fetched
    empty = RoutingState(state.loads, state.cached_blocks, state.queued_tokens, 16, state.mean_in_flight,
                         state.fetchable_blocks, cluster_committed=0.05)
    assert policy.pick(workers, route, empty).worker_id == "w0"


def test_prefix_replicates_by_fetch_only_where_the_pool_has_room():
    """Two workers both idle but the holder has a queue: with a roomy pool the other one
    takes the request and fetches the prefix from the holder; when its pool is committed to
    other reused prefixes, the request waits on the holder instead."""
    workers, route = _workers(2), _route(4, blocks=16)     # 16 shared blocks + 3 own tokens
    policy = make_policy("kv_aware")
    state = lambda shared: RoutingState(  # noqa: E731
        {"w0": WorkerLoad(1, 100, 1000, shared_blocks=16), "w1": WorkerLoad(0, 100, 1000, shared_blocks=shared)},
        cached_blocks={"w0": 16}, queued_tokens={"w0": 64}, fetchable_blocks={"w1": 16})
    assert policy.pick(workers, route, state(0)).worker_id == "w1"
    assert policy.pick(workers, route, state(800)).worker_id == "w0"


def test_a_new_prefix_goes_where_it_displaces_the_fewest_shared_blocks():
    workers, route = _workers(2), _route(5, blocks=16)
    policy = make_policy("kv_aware")
    loads = {"w0": WorkerLoad(1, 10, 112, shared_blocks=96), "w1": WorkerLoad(1, 30, 112, shared_blocks=64)}
    assert policy.pick(workers, route, RoutingState(loads)).worker_id == "w1"
    swapped = {"w0": loads["w1"], "w1": loads["w0"]}
    assert policy.pick(workers, route, RoutingState(swapped)).worker_id == "w0"


def test_successors_of_a_finished_batch_spread_over_the_workers():
    """Closed loop: w0's requests just finished together (1 left vs 4 on w1). The first
    successor goes to w0; the second sees w0's queued prefill (γ = 2) and goes to w1 rather
    than sharing w0's prefill step, although w0 still runs fewer requests."""
    workers, route = _workers(2), _route(6, blocks=16)
    policy = make_policy("kv_aware")
    both = {"w0": 16, "w1": 16}
    first = RoutingState({"w0": WorkerLoad(1), "w1": WorkerLoad(4)}, both)
    assert policy.pick(workers, route, first).worker_id == "w0"
    second = RoutingState({"w0": WorkerLoad(2), "w1": WorkerLoad(4)}, both, queued_tokens={"w0": 35})
    assert policy.pick(workers, route, second).worker_id == "w1"


def test_bounded_load_filter_lets_the_longest_holders_reach_holder_factor_times_the_cap():
    workers = _workers(4)
    loads = {"w0": WorkerLoad(4), "w1": WorkerLoad(4), "w2": WorkerLoad(0), "w3": WorkerLoad(0)}
    cap = load_cap(8, 4, 1.25)                       # 3: w0 and w1 are over it
    assert cap == 3
    f = BoundedLoadFilter(1.25, holder_factor=2.0)
    kept = lambda cached: [w.worker_id for w in f.keep(workers, _route(0), RoutingState(loads, cached))]  # noqa: E731
    assert kept({"w0": 5, "w1": 2}) == ["w0", "w2", "w3"]      # w1 holds less than the longest: cap
    assert kept({"w0": 5, "w1": 5}) == ["w0", "w1", "w2", "w3"]
    assert kept({}) == ["w2", "w3"]                              # a cold prompt: nobody is a holder
    assert [w.worker_id for w in BoundedLoadFilter(1.25).keep(workers, _route(0), RoutingState(loads, {"w0": 5}))] \
        == ["w2", "w3"]
    busy = loads | {"w0": WorkerLoad(10)}                         # 10 = 2 × ceil(1.25 × 15 / 4)
    assert load_cap(14, 4, 1.25) == 5
    assert [w.worker_id for w in f.keep(workers, _route(0), RoutingState(busy, {"w0": 5}))] == ["w1", "w2", "w3"]


def test_sustained_load_counts_above_the_fair_share_only():
    """fair share = (Σ mean_in_flight + 1) / n; only the excess over (1 + ε) × it costs κ̄ per
    request (ε = `sustained_tolerance`, 0.1: equally popular prefixes drift that much)."""
    workers, route = _workers(2), _route(1, blocks=4)
    scorer = PrefillCostScorer(sustained_cost_tokens=1024.0)
    # Nearly idle: one short request a while ago on w0 is no reason to leave it (equal scores).
    idle = RoutingState(mean_in_flight={"w0": 0.3, "w1": 0.0})
    assert fair_share(workers, idle) == pytest.approx(0.65)
    assert scorer.score(workers, route, idle) == {"w0": 0.0, "w1": 0.0}
    # Loaded 6 : 2 on average: w0 is 6 − 1.1 × 4.5 = 1.05 requests over its tolerated share, 1075 tokens.
    loaded = RoutingState(mean_in_flight={"w0": 6.0, "w1": 2.0})
    assert fair_share(workers, loaded) == pytest.approx(4.5)
    base = scorer.cost(WorkerId("w1"), route, loaded, 4.5)
    assert scorer.cost(WorkerId("w0"), route, loaded, 4.5) == pytest.approx(base + 1.05 * 1024.0)
    # Within the tolerance (4.9 ≤ 1.1 × 4.5): no sustained cost at all.
    drift = RoutingState(mean_in_flight={"w0": 4.9, "w1": 3.1})
    assert scorer.cost(WorkerId("w0"), route, drift, 4.5) == scorer.cost(WorkerId("w1"), route, drift, 4.5)
    strict = PrefillCostScorer(sustained_cost_tokens=1024.0, sustained_tolerance=0.0)
    assert strict.cost(WorkerId("w0"), route, loaded, 4.5) == pytest.approx(base + 1536.0)


def test_the_sustained_tolerance_shrinks_with_the_pool():
    """ε × (2 / n)^¼ in a pool of n > 2 (the whole ε at 2 or fewer): a worker 10% busier than
    the others is within the tolerance of a pair, past that of 16 workers, where the fleet's
    imbalance is the largest of 16."""
    scorer = PrefillCostScorer(sustained_cost_tokens=1024.0)
    assert scorer.tolerance(1) == scorer.tolerance(2) == 0.1
    assert scorer.tolerance(16) == pytest.approx(0.1 * (2 / 16) ** 0.25)     # 0.059
    assert PrefillCostScorer(tolerance_exponent=0.0).tolerance(16) == 0.1
    pair, fleet = _workers(2), _workers(16)
    route = _route(1, blocks=4)
    mean = {"w0": 1.1 * 4.0} | {f"w{i}": 4.0 for i in range(1, 16)}
    state = RoutingState(mean_in_flight=mean)
    share = fair_share(fleet, state)
    assert scorer.cost(WorkerId("w0"), route, state, share, pool_size=2) == \
        scorer.cost(WorkerId("w1"), route, state, share, pool_size=2)
    over = scorer.cost(WorkerId("w0"), route, state, share, pool_size=16) - \
        scorer.cost(WorkerId("w1"), route, state, share, pool_size=16)
    assert over == pytest.approx(1024.0 * (1.1 * 4.0 - share * (1 + scorer.tolerance(16))))
    assert over > 0
    scores = scorer.score(fleet, route, state)
    assert scores["w0"] < scores["w1"]
    assert scorer.score(pair, route, RoutingState(mean_in_flight={"w0": 1.1 * 4.0, "w1": 4.0})) == \
        {"w0": 0.0, "w1": 0.0}
    with pytest.raises(ValueError, match="tolerance_exponent"):
        PrefillCostScorer(tolerance_exponent=-1.0)
