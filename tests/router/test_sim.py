"""The routing simulation behind `kvmesh bench router` runs the real policies; the oracle bounds them."""
from __future__ import annotations

from router.routing import RoutingPolicy
from router.sim import SimConfig, make_trace, oracle_hit_rate, simulate


def test_simulation_runs_every_policy_under_the_oracle():
    cfg = SimConfig(num_workers=4, num_requests=300, num_prompts=16, cache_blocks=160)
    trace = make_trace(cfg)
    oracle = oracle_hit_rate(cfg, trace)
    results = {p: simulate(p, cfg, trace) for p in RoutingPolicy}
    for p, r in results.items():
        assert 0.0 <= r.hit_rate <= oracle + 1e-9, p
        assert r.imbalance >= 1.0, p
    # cache-aware routing keeps more of the prefix cache than the cache-blind baseline
    assert results[RoutingPolicy.KV_AWARE].hit_rate > results[RoutingPolicy.ROUND_ROBIN].hit_rate
    assert results[RoutingPolicy.PREFIX_HASH].hit_rate > results[RoutingPolicy.ROUND_ROBIN].hit_rate
