"""Pending (in-flight) blocks in the block index and holder-first placement over a real
`BlockIndex`: recorded at dispatch, confirmed by BlockStored, expired, dropped on
failure; a pending prefix draws followers; the holder wins until its queue outweighs the
prefill it saves."""
from __future__ import annotations

import asyncio

import pytest

from kvstore.events import EventType, Tier, WireEvent, WorkerId
from kvstore.keys import block_hashes
from router.index.blocks import BlockIndex
from router.routing.inflight import InFlightConfig, InFlightPrefills
from router.routing.policy import make_policy
from router.routing.types import RouteRequest, RoutingPolicy, RoutingState, WorkerInfo, WorkerLoad

SALT = b"pending-test"
BS = 16
W0, W1 = WorkerId("w0"), WorkerId("w1")
WORKERS = [WorkerInfo(W0, "a:1"), WorkerInfo(W1, "a:2")]


def _route(prefix: int, question: int, prefix_blocks: int = 8) -> RouteRequest:
    ids = tuple([1000 + prefix] * (prefix_blocks * BS) + [5000 + question] * (2 * BS))
    return RouteRequest(ids, tuple(block_hashes(ids, BS, SALT)))


def _stored(*hashes: int) -> WireEvent:
    return WireEvent(EventType.STORED, tuple(hashes), None, Tier.DEVICE)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pending_is_recorded_matched_and_confirmed_by_block_stored() -> None:
    index = BlockIndex()
    index.apply(W1, _stored())           # w1 known, holding nothing
    lead = _route(0, 0)
    index.add_pending("r1", W0, lead.block_hashes, expires_at=160.0)
    follower = _route(0, 1)
    # A pending prefix draws a follower like a stored one; the stored-only view does not see it.
    assert index.match_prefix(follower.block_hashes, [W0, W1]) == {W0: 8, W1: 0}
    assert index.match_prefix(follower.block_hashes, [W0, W1], pending=False) == {W0: 0, W1: 0}
    assert index.computing(W0, follower.block_hashes) == {"r1"}
    assert index.stats().num_pending == 10
    # The worker's BlockStored events confirm the prediction block by block.
    index.apply(W0, _stored(*lead.block_hashes[:8]))
    assert index.stats().num_pending == 2 and index.computing(W0, follower.block_hashes) == set()
    assert index.match_prefix(follower.block_hashes, [W0], pending=False) == {W0: 8}
    index.check_integrity()
    index.apply(W0, _stored(*lead.block_hashes[8:]))
    assert index.stats().num_pending == 0
    index.drop_pending("r1")             # nothing left to drop; stored blocks stay
    assert index.match_prefix(lead.block_hashes, [W0]) == {W0: 10}
    index.check_integrity()


def test_pending_expires_and_is_dropped_on_failure() -> None:
    index = BlockIndex()
    a, b = _route(0, 0), _route(1, 0)
    index.add_pending("ra", W0, a.block_hashes, expires_at=110.0)
    index.add_pending("rb", W1, b.block_hashes, expires_at=200.0)
    assert index.expire_pending(109.9) == 0
    assert index.expire_pending(110.0) == 1
    assert index.match_prefix(a.block_hashes, [W0, W1]) == {W0: 0, W1: 0}
    assert index.match_prefix(b.block_hashes, [W0, W1]) == {W0: 0, W1: 10}
    # Settling (prefill done) shortens the expiry; failure drops at once.
    index.settle_pending("rb", 150.0)
    assert index.expire_pending(150.0) == 1 and index.stats().num_pending == 0
    index.add_pending("rc", W1, b.block_hashes, expires_at=300.0)
    index.drop_pending("rc")
    assert index.match_prefix(b.block_hashes, [W1]) == {W1: 0} and index.pending_requests() == []
    index.remove_worker(W1)
    index.check_integrity()


def test_a_second_request_records_only_what_no_one_computes_and_remove_worker_drops_pending() -> None:
    index = BlockIndex()
    index.add_pending("r1", W0, _route(0, 0).block_hashes, expires_at=200.0)
    index.add_pending("r2", W0, _route(0, 1).block_hashes, expires_at=200.0)
    assert index.stats().num_pending == 12          # 8 shared prefix blocks + 2 + 2 questions
    assert index.computing(W0, _route(0, 2).block_hashes) == {"r1"}
    index.drop_pending("r1")                        # the leader failed: r2 computes the prefix itself
    assert index.match_prefix(_route(0, 1).block_hashes, [W0]) == {W0: 10}
    assert index.computing(W0, _route(0, 2).block_hashes) == {"r2"}
    index.drop_pending("r2")
    assert index.match_prefix(_route(0, 1).block_hashes, [W0]) == {W0: 0}
    index.remove_worker(W0)
    assert index.pending_requests() == [] and index.stats().num_pending == 0
    index.check_integrity()


def _state(index: BlockIndex, prefills: InFlightPrefills, route: RouteRequest,
           in_flight: dict[str, int] | None = None) -> RoutingState:
    loads = {w.worker_id: WorkerLoad((in_flight or {}).get(w.worker_id, 0), 100, 100) for w in WORKERS}
    return RoutingState(loads, index.match_prefix(route.block_hashes, list(loads)),  # type: ignore[arg-type]
                        prefills.queued_tokens(index, loads, route), BS, prefills.mean_in_flight(loads))


def test_holder_first_follows_a_pending_prefix_until_its_queue_outweighs_the_saving() -> None:
    """kv_aware over a real index: a burst for one prefix goes where it is being computed,
    and spills (a deliberate replica) once the holder's queued prefill exceeds the saving."""
    clock = Clock()
    index, prefills = BlockIndex(), InFlightPrefills(InFlightConfig(), clock)
    index.apply(W0, _stored())
    index.apply(W1, _stored())
    policy = make_policy(RoutingPolicy.KV_AWARE)

    async def burst() -> list[str]:
        picks, in_flight = [], {W0: 0, W1: 0}
        for i, (prefix, q) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]):
            route = _route(prefix, q)
            state = _state(index, prefills, route, in_flight)
            w = policy.pick(WORKERS, route, state)
            assert w is not None
            prefills.dispatched(index, f"r{i}", w.worker_id, route, state.cached_blocks[w.worker_id] * BS)
            in_flight[w.worker_id] += 1
            picks.append(w.worker_id)
        return picks

    picks = asyncio.run(burst())
    # Two new prefixes go to different workers (queued prefill spreads them); each follower
    # goes to the worker computing its prefix although none is stored yet.
    assert picks[0] != picks[1] and picks[2] == picks[0] and picks[3] == picks[1] and picks[4] == picks[0]
    # A holder with a long foreign prefill queue loses to an idle worker: the queue (3 cold
    # prompts of 160 tokens) costs more than the 128 prefix tokens it saves.
    hot = picks[0]
    for i, p in enumerate((7, 8, 9)):
        prefills.dispatched(index, f"cold{i}", hot, _route(p, 0), 0)
    route = _route(0, 3)
    state = _state(index, prefills, route)
    assert state.cached_blocks[hot] == 8
    assert policy.pick(WORKERS, route, state).worker_id != hot   # type: ignore[union-attr]


def test_followers_wait_for_the_leader_prefill_and_failures_release_them() -> None:
    clock = Clock()
    index, prefills = BlockIndex(), InFlightPrefills(InFlightConfig(max_wait_s=5.0), clock)

    async def scenario() -> tuple[bool, bool, int]:
        prefills.dispatched(index, "lead", W0, _route(0, 0), 0)
        prefills.dispatched(index, "f1", W0, _route(0, 1), 8 * BS)
        assert prefills.queued_tokens(index, [W0], _route(0, 2)) == {W0: 32}   # f1's question only
        waiter = asyncio.ensure_future(prefills.wait_for_leaders("f1", 10.0))
        await asyncio.sleep(0.01)
        held = not waiter.done()
        prefills.prefilled(index, "lead")               # first response of the leader
        await asyncio.wait_for(waiter, 1.0)
        # A follower of a leader that fails before streaming is released, and the prediction goes.
        prefills.dispatched(index, "lead2", W1, _route(1, 0), 0)
        prefills.dispatched(index, "f2", W1, _route(1, 1), 8 * BS)
        waiter2 = asyncio.ensure_future(prefills.wait_for_leaders("f2", 10.0))
        await asyncio.sleep(0.01)
        prefills.done(index, "lead2", streamed=False)
        await asyncio.wait_for(waiter2, 1.0)
        return held, waiter2.done(), index.match_prefix(_route(1, 2).block_hashes, [W1])[W1]

    held, released, lead2_blocks = asyncio.run(scenario())
    assert held and released and prefills.waits == 2
    assert lead2_blocks == 8    # lead2's prediction went with it; f2, released, computes the prefix
    assert "lead2" not in index.pending_requests() and index.computing(W1, _route(1, 2).block_hashes) == {"f2"}
    # The leader's prediction stays while it streams (its blocks are in use on the worker,
    # whatever the events' delay) and expires the grace after it ends unless confirmed.
    clock.now += InFlightConfig().settle_s + 0.1
    prefills.expire(index)
    assert "lead" in index.pending_requests()
    prefills.done(index, "lead", streamed=True)
    clock.now += InFlightConfig().settle_s - 0.1
    prefills.expire(index)
    assert "lead" in index.pending_requests()
    clock.now += 0.2
    prefills.expire(index)
    assert "lead" not in index.pending_requests()
    index.check_integrity()


def test_sustained_load_is_the_time_average_of_attempts_in_flight() -> None:
    """Oracle: the exponentially weighted average of a step function, in closed form."""
    import math
    clock = Clock()
    tau = InFlightConfig().load_window_s
    prefills = InFlightPrefills(InFlightConfig(), clock)
    index = BlockIndex()

    async def scenario() -> None:
        prefills.dispatched(index, "a", W0, _route(0, 0), 0)
        prefills.dispatched(index, "b", W0, _route(0, 1), 0)
        assert prefills.mean_in_flight([W0, W1]) == {W0: 0.0, W1: 0.0}     # no time has passed
        clock.now += tau
        m = prefills.mean_in_flight([W0])[W0]
        assert math.isclose(m, 2 * (1 - math.exp(-1)))
        prefills.prefilled(index, "a")          # streaming: still in flight
        prefills.done(index, "b", streamed=False)
        clock.now += tau / 2
        m2 = 1 + (m - 1) * math.exp(-0.5)
        assert math.isclose(prefills.mean_in_flight([W0])[W0], m2)
        prefills.done(index, "a", streamed=True)
        prefills.done(index, "a", streamed=True)   # a second `done` of one attempt counts once
        clock.now += tau
        assert math.isclose(prefills.mean_in_flight([W0])[W0], m2 * math.exp(-1))
        # A re-dispatch (retry on another worker) moves the attempt: it is counted once.
        prefills.dispatched(index, "c", W0, _route(1, 0), 0)
        prefills.dispatched(index, "c", W1, _route(1, 0), 0)
        clock.now += 1000 * tau
        mean = prefills.mean_in_flight([W0, W1])
        assert math.isclose(mean[W0], 0.0, abs_tol=1e-9) and math.isclose(mean[W1], 1.0)

    asyncio.run(scenario())


def test_a_burst_waits_on_the_holder_but_sustained_load_replicates_the_prefix() -> None:
    """kv_aware over a real index: the holder keeps a prefix through a burst over the
    bounded-load cap (up to twice it), and loses new traffic for it to an idle worker once
    it has carried more load for a while (κ̄ × the difference > β × the prefill saved)."""
    clock = Clock()
    index, prefills = BlockIndex(), InFlightPrefills(InFlightConfig(load_window_s=10.0), clock)
    index.apply(W0, _stored())
    index.apply(W1, _stored())
    policy = make_policy(RoutingPolicy.KV_AWARE)
    hot = _route(0, 0, prefix_blocks=32)            # 512 prefix tokens: β × saved = 1024

    async def scenario() -> tuple[list[str], str]:
        prefills.dispatched(index, "lead", W0, hot, 0)
        prefills.prefilled(index, "lead")
        index.apply(W0, _stored(*hot.block_hashes))
        in_flight = {W0: 1, W1: 0}
        picks = []
        for i in range(3):      # a burst: w0 goes over the cap ceil(1.25 × (m + 1) / 2)
            route = _route(0, i + 1, prefix_blocks=32)
            state = _state(index, prefills, route, in_flight)
            w = policy.pick(WORKERS, route, state)
            assert w is not None
            prefills.dispatched(index, f"b{i}", w.worker_id, route, state.cached_blocks[w.worker_id] * BS)
            prefills.prefilled(index, f"b{i}")
            in_flight[w.worker_id] += 1
            picks.append(w.worker_id)
        # The burst lasts: w0's time-averaged load climbs to ~4 while w1 idles.
        clock.now += 30.0
        route = _route(0, 9, prefix_blocks=32)
        state = _state(index, prefills, route, in_flight)
        assert state.mean_in_flight[W0] > 3.5 and state.mean_in_flight[W1] == 0.0
        late = policy.pick(WORKERS, route, state)
        assert late is not None
        return picks, late.worker_id

    picks, late = asyncio.run(scenario())
    assert picks == [W0, W0, W0]     # the last two at the plain cap (2 of 2, then 3 of 3 in flight)
    assert late == W1


def test_a_request_fetching_its_prefix_from_a_peer_queues_only_what_it_computes() -> None:
    """A request sent where a peer will send the prefix (a peer hint) computes only the rest:
    that is what it queues there, not the whole prompt (else the next requests shun the worker
    as if a cold prefill were queued)."""
    index, prefills = BlockIndex(), InFlightPrefills()
    route = _route(0, 0)                                    # 8 prefix blocks + 2 question blocks
    prefills.dispatched(index, "fetching", W1, route, 8 * BS)   # its 8 prefix blocks fetched
    prefills.dispatched(index, "cold", W0, _route(1, 0), 0)
    assert prefills.queued_tokens(index, [W0, W1], _route(2, 0)) == {W0: 10 * BS, W1: 2 * BS}
    # the fetched blocks are pending on the receiver: it will hold them once stored
    assert index.match_prefix(_route(0, 1).block_hashes, [W1]) == {W1: 8}
    prefills.prefilled(index, "fetching")
    assert prefills.queued_tokens(index, [W0, W1], _route(2, 0)) == {W0: 10 * BS, W1: 0}


def test_a_retried_request_counts_its_prompt_once_as_evidence_of_sharing() -> None:
    """A failed attempt drops its pending blocks; the retry (`resubmitted=True`, which the
    router passes for every attempt after the first) records them again without a second ask
    for blocks held somewhere (their counts were kept), so one request's prompt does not look
    shared (asked for twice); blocks held nowhere had their counts forgotten: asked once again."""
    route = _route(0, 0)
    n = len(route.block_hashes)
    for resubmitted, expected in ((True, n / 3), (False, n)):    # asked once: rate (0 + 1) / (1 + 2)
        index, prefills = BlockIndex(), InFlightPrefills(InFlightConfig(), Clock())
        index.apply(W0, _stored(*route.block_hashes))            # W0 holds the prompt
        prefills.dispatched(index, "r", W1, route, 0)
        prefills.done(index, "r", streamed=False)                # W1 died before streaming
        prefills.dispatched(index, "r", W1, route, 0, resubmitted=resubmitted)
        assert index.shared_blocks(W0) == pytest.approx(expected)
        index.check_integrity()
    index, prefills = BlockIndex(), InFlightPrefills(InFlightConfig(), Clock())
    prefills.dispatched(index, "r", W0, route, 0)
    prefills.done(index, "r", streamed=False)                    # held nowhere: counts forgotten
    prefills.dispatched(index, "r", W1, route, 0, resubmitted=True)
    index.apply(W1, _stored(*route.block_hashes))
    # asked once each; each depth's tally of first asks (kept for ever) counts both: 1 / (2 + 2)
    assert index.shared_blocks(W1) == pytest.approx(n / 4)
    index.check_integrity()


def test_an_index_no_event_stream_feeds_predicts_nothing_and_only_the_queue_is_tracked() -> None:
    """A router without a metadata Redis holds an index that is not fed: dispatching records
    no pending blocks and counts no asks, so every worker matches 0 blocks and each queues
    its whole prompt; the same dispatches into a fed index draw the second to the first."""
    route = _route(0, 0)
    for fed in (False, True):
        index, prefills = BlockIndex(fed=fed), InFlightPrefills(InFlightConfig(), Clock())
        prefills.dispatched(index, "a", W0, route, 0)
        prefills.dispatched(index, "b", W1, route, 0)
        index.check_integrity()
        if fed:
            assert index.match_prefix(route.block_hashes, [W0, W1]) == {W0: 10, W1: 10}
            assert index.pending_requests() == ["a", "b"]
            continue
        assert index.match_prefix(route.block_hashes, [W0, W1]) == {W0: 0, W1: 0}
        assert index.pending_requests() == [] and index.stats().num_pending == 0
        assert index.shared_blocks(W0) == 0.0 and index.distinct_shared_blocks() == 0.0
        assert prefills.queued_tokens(index, [W0, W1], route) == {W0: len(route.token_ids), W1: len(route.token_ids)}
        prefills.done(index, "a", streamed=True)
        prefills.done(index, "b", streamed=False)
        assert index.stats().num_pending == 0


@pytest.mark.parametrize("make", ["BlockIndex", "CompactBlockIndex"])
def test_computing_any_names_every_request_computing_the_blocks(make: str) -> None:
    """`computing_any` (the requests computing any of some blocks, per worker: the queued tokens
    a pick takes off) against the pending map itself, through records on many workers at once
    (a popular prefix pending on several), confirmations, evictions under running requests,
    drops, settles and expiry; `check_integrity` checks the per-block request sets kept for it."""
    import random

    from kvstore.keys import BlockHash
    from router.index.compact import CompactBlockIndex

    rng = random.Random(11)
    index = BlockIndex() if make == "BlockIndex" else CompactBlockIndex()
    workers = [WorkerId(f"w{i}") for i in range(9)]
    pool = [BlockHash(0x5000 + i) for i in range(14)]
    live: list[str] = []
    multi = 0
    for step in range(1500):
        kind = rng.random()
        w = rng.choice(workers)
        if kind < 0.4:
            rid = f"r{step}"
            start = rng.randrange(0, 6)
            index.add_pending(rid, w, pool[start:start + rng.randrange(1, 9)], expires_at=float(step + 40))
            live.append(rid)
        elif kind < 0.55 and live:
            index.drop_pending(live.pop(rng.randrange(len(live))))
        elif kind < 0.65 and live:
            index.settle_pending(rng.choice(live), expires_at=float(step + 5))
        elif kind < 0.8:
            index.apply(w, _stored(*rng.sample(pool, 2)))             # confirms what it computed
        elif kind < 0.95:
            index.discard(w, rng.sample(pool, 3), Tier.DEVICE)       # lost under running requests
        else:
            index.expire_pending(float(step))
        index.check_integrity()
        by_block = index._pending.by_block
        multi += any(len(c) > 2 for c in by_block.values())
        query = rng.sample(pool, rng.randrange(1, 8))
        want: dict[WorkerId, set[str]] = {}
        for h in query:
            for on, rids in by_block.get(h, {}).items():
                want.setdefault(on, set()).update(rids)
        assert index.computing_any(query) == want, step
    assert multi > 100
