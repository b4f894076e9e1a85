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
    # with prefill queues modelled, the hits show in TTFT too (the live ordering, issue #23)
    assert results[RoutingPolicy.KV_AWARE].ttft_p50 < results[RoutingPolicy.ROUND_ROBIN].ttft_p50
    assert results[RoutingPolicy.KV_AWARE].hit_rate >= results[RoutingPolicy.PREFIX_HASH].hit_rate


def test_pending_blocks_draw_followers_to_the_worker_computing_their_prefix():
    """A burst of one prompt at once: the router's index sees the first request's blocks as
    pending, so kv_aware sends the followers to the same worker (one cold prefill in all)."""
    cfg = SimConfig(num_workers=2, num_requests=4, num_prompts=1, mean_in_flight=200.0, suffix_blocks=(1, 1),
                    load_factor=4.0)   # a cap that does not force a spill: this is about the index
    trace = make_trace(cfg)
    assert simulate(RoutingPolicy.KV_AWARE, cfg, trace).hit_rate == oracle_hit_rate(cfg, trace)
    assert simulate(RoutingPolicy.ROUND_ROBIN, cfg, trace).hit_rate < oracle_hit_rate(cfg, trace)
