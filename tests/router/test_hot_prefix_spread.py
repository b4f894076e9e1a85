"""A hot prefix in a roomy cluster spreads by peer fetch as soon as its holder is the busier
worker (issue #39, no-pressure TTFT): the pick traced in `kvmesh bench routing-live`'s default
no-pressure scenario (23:13 UTC, pools of 1,456 blocks), where pricing the copy from a fill of 0
kept the prefix on its holder at 5 requests in flight against 2, and its warm requests shared
their prefill steps. The column pick and `Policy.pick` agree on it."""
from __future__ import annotations

from kvstore.keys import block_hashes
from router.routing.fastpick import Columns, KvAwareFast
from router.routing.policy import Policy, Weighted, make_policy
from router.routing.scorers import PrefillCostScorer
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo, WorkerLoad

W0, W1 = WorkerId("worker-0"), WorkerId("worker-1")
WORKERS = [WorkerInfo(W0, "a:0"), WorkerInfo(W1, "a:1")]
IDS = tuple(range(1000, 1544))                     # a 512-token prefix + a 32-token question
ROUTE = RouteRequest(IDS, tuple(block_hashes(IDS, 16, b"hot-prefix")))


def _traced(in_flight: tuple[int, int], cluster_committed: float = 0.109) -> RoutingState:
    """The traced pick: worker-0 holds the prefix (32 blocks), worker-1 can fetch it."""
    return RoutingState({W0: WorkerLoad(in_flight[0], 1000, 1456, shared_blocks=127.8),
                         W1: WorkerLoad(in_flight[1], 1000, 1456, shared_blocks=95.7)},
                        cached_blocks={W0: 32}, block_size=16, mean_in_flight={W0: 2.9, W1: 2.4},
                        fetchable_blocks={W1: 32}, cluster_committed=cluster_committed)


def _both(policy: Policy, state: RoutingState) -> WorkerId:
    """The reference pick's worker, checked against the column pick's."""
    want = policy.pick(WORKERS, ROUTE, state)
    fast = KvAwareFast.of(policy)
    assert want is not None and fast is not None
    at = fast.pick(Columns.from_state(WORKERS, state), ROUTE, 16, 32, state.cluster_committed)
    assert at is not None and WORKERS[at] == want
    return want.worker_id


def test_the_busier_holder_of_a_hot_prefix_loses_it_to_a_cheap_fetch():
    policy = make_policy("kv_aware")
    assert _both(policy, _traced((5, 2))) == W1                 # fetched: the holder runs 3 more
    from_zero = Policy(policy.name, (Weighted(PrefillCostScorer(copy_room_frac=0.0), 1.0),), policy.filters,
                       policy.tiebreak)
    assert _both(from_zero, _traced((5, 2))) == W0              # the old price: 2 × 0.12 × 512 tokens
    # equal load keeps the affinity (the fetch is not free), and a cluster past the room prices
    # the copy again: a replica must then buy its place with load
    assert _both(policy, _traced((3, 3))) == W0
    assert _both(policy, _traced((5, 2), cluster_committed=0.5)) == W0
