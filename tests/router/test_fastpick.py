"""The kv_aware column pick (router/routing/fastpick.py) against the reference `Policy.pick`:
the same worker on random states (loads, holders, pending, queues, exclusions, ties), and,
through a real registry, block index and in-flight table, the same `Router.pick` as the
reference on the dict state the router built before the columns (router/routing/pick.py
`reference_view`)."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from kvstore.events import EventType, Tier, WireEvent
from kvstore.keys import BlockHash
from router.routing import holders
from router.routing.fastpick import Columns, KvAwareFast
from router.routing.pick import best_peer_hint, reference_view
from router.routing.policy import Policy, make_policy
from router.routing.scorers import BoundedLoadFilter, PrefillCostScorer, RingScorer
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo, WorkerLoad


def _request(rng: random.Random, bs: int) -> RouteRequest:
    tokens = rng.choice([0, 1, bs - 1, bs, 3 * bs + 1, rng.randrange(1, 40 * bs)])
    ids = tuple(rng.randrange(50000) for _ in range(tokens))
    hashes = tuple(BlockHash(rng.getrandbits(128)) for _ in range(tokens // bs))
    return RouteRequest(ids, hashes)


def _state(rng: random.Random, workers: list[WorkerInfo], bs: int) -> RoutingState:
    """A random state; `tie` draws from few values so that equal scores are common."""
    tie = rng.random() < 0.5
    small = (lambda hi: rng.choice([0, hi // 2, hi])) if tie else (lambda hi: rng.randrange(hi + 1))
    loads, cached, queued, mean, fetchable, disk = {}, {}, {}, {}, {}, {}
    for w in workers:
        wid = w.worker_id
        if rng.random() < 0.9:
            nb = rng.choice([0, 64, 256, 1000])
            loads[wid] = WorkerLoad(in_flight=small(8), free_blocks=rng.randrange(nb + 1), num_blocks=nb,
                                    shared_blocks=rng.choice([0.0, nb * 0.1, nb * rng.random(), 1e-12]),
                                    disk_read_cost=rng.choice([0.0, 0.0, 0.05, rng.random() * 2]))
        if rng.random() < 0.3:
            cached[wid] = small(12)
        if rng.random() < 0.5:
            queued[wid] = rng.choice([0, 17, 250, -3, rng.randrange(2000)]) if not tie else small(500)
        if rng.random() < 0.7:
            mean[wid] = rng.choice([0.0, 1.0, rng.random() * 6]) if tie else rng.random() * 6
        if rng.random() < 0.3:
            fetchable[wid] = small(8)
        if wid in cached and rng.random() < 0.5:
            disk[wid] = rng.randrange(cached[wid] + 1)
    return RoutingState(loads, cached, queued, bs, mean, fetchable, rng.choice([0.0, 0.1, rng.random(), 1.0]), disk)


def _policies(rng: random.Random) -> list[Policy]:
    lf = rng.choice([1.0, 1.25, 2.0])
    tuned = PrefillCostScorer(running_cost_tokens=rng.choice([0.0, 16.0, 100.0]), fetch_cost_ratio=rng.random(),
                              room_frac=rng.choice([0.0, 0.2, 0.9]), sustained_tolerance=rng.random(),
                              tolerance_exponent=rng.choice([0.0, 0.25, 1.0]),
                              copy_room_frac=rng.choice([0.0, 0.2, 0.5]))
    return [make_policy("kv_aware", lf),
            replace(make_policy("kv_aware", lf), scorers=(replace(make_policy("kv_aware").scorers[0],
                                                                  scorer=tuned, weight=rng.choice([0.5, 3.0])),),
                    filters=(BoundedLoadFilter(lf, holder_factor=rng.choice([1.0, 3.0])),),
                    tiebreak=RingScorer(num_prefix_blocks=rng.choice([1, 4]), ))]


@pytest.mark.parametrize("seed", range(4))
def test_the_column_pick_is_the_reference_pick(seed: int) -> None:
    rng = random.Random(seed)
    ties = many = 0
    for trial in range(350):
        n = rng.choice([1, 2, 3, 8, 20, 60]) if trial % 25 else 120
        workers = [WorkerInfo(WorkerId(f"w{rng.randrange(10**6)}-{i}"), f"a:{i}") for i in range(n)]
        bs = rng.choice([1, 16])
        state, request = _state(rng, workers, bs), _request(rng, bs)
        if trial % 25 == 0:         # a cold index and an idle pool: every worker ties
            state = RoutingState(block_size=bs, cluster_committed=state.cluster_committed)
        exclude = {w.worker_id for w in workers if rng.random() < 0.2} if rng.random() < 0.3 else set()
        for policy in _policies(rng):
            fast = KvAwareFast.of(policy)
            assert fast is not None
            want = policy.pick(workers, request, state, exclude=exclude)
            pool = [w for w in workers if w.worker_id not in exclude]
            most = max(state.cached_blocks.values(), default=0)
            at = fast.pick(Columns.from_state(pool, state), request, bs, most, state.cluster_committed)
            got = None if at is None else pool[at]
            assert got == want, (seed, trial, policy)
            if pool:
                costs = fast.costs(Columns.from_state(pool, state), request, bs, most, state.cluster_committed)
                for w, c in zip(pool, costs.tolist()):   # the very floats the scorer computes
                    assert c == policy.scorers[0].scorer.cost(  # type: ignore[attr-defined]
                        w.worker_id, request, state,
                        (sum(max(0.0, state.mean_in_flight.get(x.worker_id, 0.0)) for x in pool) + 1.0) / len(pool),
                        most, len(pool))
                ties += len(set(costs.tolist())) < len(pool)
                many += len(pool) > 48 and len(set(costs.tolist())) == 1
    assert ties > 100 and many > 0     # equal scores (the ring decides) were exercised, a big tie too


def test_other_policies_have_no_column_pick() -> None:
    for name in ("round_robin", "least_loaded", "prefix_hash"):
        assert KvAwareFast.of(make_policy(name)) is None
    assert KvAwareFast.of(make_policy("kv_aware")) is not None


@pytest.mark.parametrize("many_holders", [0, holders.MANY_HOLDERS])    # the holders' figures in numpy / loops
def test_router_pick_matches_the_reference_over_a_real_index(many_holders: int, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from kvmesh.bench.scale_pick import SyntheticConfig, synthetic_router

    monkeypatch.setattr(holders, "MANY_HOLDERS", many_holders)

    async def go() -> None:
        now = [0.0]
        router, trace = synthetic_router(SyntheticConfig(workers=60, pool_blocks=200, trace_requests=150,
                                                         in_flight=30, seed=3), clock=lambda: now[0])
        rng = random.Random(5)
        index, entries = router.registry.index, router.registry.live()
        for e in entries[::3]:              # a third of the workers price their disk reads; some hold prompts on disk
            e.disk_read_cost = rng.choice([0.1, 0.6, 1.3])
        for k, route in enumerate(trace[:60:4]):
            wid = entries[(7 * k) % len(entries)].info.worker_id  # type: ignore[union-attr]
            index.apply(wid, WireEvent(EventType.STORED, route.block_hashes, None, Tier.DISK))
        disk_seen = hints = 0
        for i, route in enumerate(trace):
            now[0] += rng.choice([0.0, 0.01, 0.5, 7.0])
            tried = {e.info.worker_id for e in rng.sample(entries, 3)} if i % 4 == 0 else set()  # type: ignore[union-attr]
            view = router._routing_view(route)
            assert view.state == reference_view(router.registry, router.prefills, route, 16).state
            disk_seen += bool(view.state.disk_blocks)
            max_blocks = rng.choice([0, 3, (len(route.token_ids) - 1) // 16])
            for chosen in [*view.stored, *rng.sample(view.ids, 3)]:     # the hint in columns is best_peer_hint's
                want_hint = best_peer_hint(chosen, view.stored, view.peers, max_blocks)
                assert view.peer_hint(chosen, max_blocks) == want_hint, (i, chosen)
                hints += want_hint is not None
            got = router.pick(route, tried)
            router.column_pick = False
            want = router.pick(route, tried)
            router.column_pick = True
            assert got == want, i
            router.prefills.dispatched(index, f"t-{i}", got.worker.info.worker_id, route,  # type: ignore[union-attr]
                                       got.predicted_tokens)
            got.worker.in_flight += 1
            if i % 3:
                router.prefills.prefilled(index, f"t-{i}")
            if i % 2:
                got.worker.in_flight -= 1
                router.prefills.done(index, f"t-{i}", streamed=True)
        index.check_integrity()
        assert disk_seen > 0            # disk-held prefixes were priced in some picks
        assert hints > 0

    asyncio.run(go())


def test_router_pick_follows_the_registry_between_picks() -> None:
    """The live columns kept between picks (router/workers/live.py) follow every change the
    registry sees — in-flight counts, a probe's pool size and peer plane, a worker marked down
    and ready again, a prefill-role worker (out of the decode pool), a worker leaving — and the
    pick stays the reference's."""
    from contracts.roles import WorkerRole
    from kvmesh.bench.scale_pick import SyntheticConfig, synthetic_router
    from router.routing.disagg import is_active

    async def go() -> None:
        now = [0.0]
        router, trace = synthetic_router(SyntheticConfig(workers=40, pool_blocks=200, trace_requests=120,
                                                         in_flight=20, seed=4), clock=lambda: now[0])
        registry, rng = router.registry, random.Random(9)
        index, entries = registry.index, registry.live()
        down: list = []
        changes = seen_active = 0
        for i, route in enumerate(trace):
            now[0] += rng.choice([0.0, 0.01, 0.5])
            e = rng.choice(entries)
            kind = i % 6
            if kind == 1:                                   # a probe's figures
                e.num_blocks, e.peer_plane = rng.choice([0, 100, 200, 400]), rng.random() < 0.5
                e.disk_read_cost = rng.choice([0.0, 0.0, 0.4, 1.2])
            elif kind == 2 and e.info is not None and len(down) < 5:       # a failed call
                down.append((e, e.info))
                registry.mark_down(e, "test")
            elif kind == 3 and down:                        # ready again, perhaps as a prefill or decode worker
                back, info = down.pop(0)
                role = rng.choice([WorkerRole.PREFILL, WorkerRole.PREFILL, WorkerRole.DECODE])
                back.info = replace(info, role=role) if rng.random() < 0.5 else info
            elif kind == 4 and i == 100:                    # a worker leaves the registry
                gone = entries.pop()
                registry.set_workers([x.address for x in entries], probe=False)
                down = [d for d in down if d[0] is not gone]
            changes += kind in (1, 2, 3)
            # the hand-off's test (router/routing/core.py `_hand_off`), kept with the columns
            active = is_active([x.info for x in registry.live()])  # type: ignore[misc]
            assert registry.live_columns().disaggregated == active, i
            seen_active += active
            tried = {x.info.worker_id for x in rng.sample(registry.live(), 2)} if i % 5 == 0 else set()  # type: ignore[union-attr]
            view = router._routing_view(route)
            assert view.state == reference_view(registry, router.prefills, route, 16).state, i
            got = router.pick(route, tried)
            router.column_pick = False
            want = router.pick(route, tried)
            router.column_pick = True
            assert got == want, i
            router.prefills.dispatched(index, f"f-{i}", got.worker.info.worker_id, route,  # type: ignore[union-attr]
                                       got.predicted_tokens)
            got.worker.in_flight += 1
            if i % 2:
                got.worker.in_flight -= 1
                router.prefills.done(index, f"f-{i}", streamed=True)
        assert changes > 50 and 0 < seen_active < len(trace)
        live = registry.live_columns()
        assert live.ids == [x.info.worker_id for x in registry.live()]  # type: ignore[union-attr]
        assert live.in_flight.tolist() == [x.in_flight for x in registry.live()]
        assert live.num_blocks.tolist() == [x.num_blocks for x in registry.live()]
        assert live.disk_cost.tolist() == [x.disk_read_cost for x in registry.live()]

    asyncio.run(go())
