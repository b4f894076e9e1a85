"""Sweeps of the routing simulator (kvmesh/bench/sim.py): how a default of the router or the
workers' pools was chosen. Each averages kv_aware (and round robin, where said) over several
traces of `kvmesh bench routing-live`'s scenarios or `kvmesh bench router --no-live`'s trace
as one setting varies; docs/routing.md gives the figures and which default each chose. Each
docstring has the command that runs it (one line, deterministic: the same figures every run)."""
from __future__ import annotations

import statistics
from typing import Any

from kvmesh.bench import routing_live as bench_live
from kvmesh.bench.routing import simulate_live_scenario
from kvmesh.bench.sim import SimConfig, make_trace, oracle_hit_rate, simulate
from router.routing.types import RoutingPolicy


def sweep_ask_half_life(quick: bool = True, seeds: int = 10,
                        half_lives: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, float("inf"))) -> dict[str, Any]:
    """kv_aware over the simulated routing-live scenarios as the router index's `ask_half_life`
    (router/index/asks.py) varies: hit rate, cold requests and imbalance averaged over `seeds`
    traces. The default `ASK_HALF_LIFE` is the best shift hit rate that costs the pressure and
    no-pressure scenarios nothing. Run it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_ask_half_life as s;
                             print(json.dumps(s(), indent=1))"
    (one line; quick sizes; `s(quick=False)` for the default ones)."""
    return _sweep("ask_half_life", half_lives, (RoutingPolicy.KV_AWARE,), quick, seeds)


def sweep_protect_turnovers(quick: bool = True, seeds: int = 20,
                            turnovers: tuple[float | None, ...] = (None, 4.0, 2.0, 1.0, 0.5, 0.25)) -> dict[str, Any]:
    """kv_aware and round robin over the simulated routing-live scenarios as the workers' pools'
    `protect_turnovers` (kvstore/pool.py: how long a reused block stays protected unused) varies:
    hit rate, cold requests and imbalance averaged over `seeds` traces. The default
    `PROTECT_TURNOVERS` is the best kv_aware shift hit rate that costs the pressure scenario
    nothing at either size and keeps `kvmesh bench router --quick --no-live` within its targets
    (docs/routing.md has the figures). Run it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_protect_turnovers as s;
                             print(json.dumps(s(), indent=1))"
    (one line; quick sizes; `s(quick=False)` for the default ones)."""
    return _sweep("protect_turnovers", turnovers, (RoutingPolicy.KV_AWARE, RoutingPolicy.ROUND_ROBIN), quick, seeds)


def sweep_copy_room(seeds: int = 8, rooms: tuple[float, ...] = (0.0, 0.2)) -> dict[str, Any]:
    """kv_aware in `kvmesh bench router --no-live`'s simulation (4, 8 and 16 workers, the quick
    trace length) as `PrefillCostScorer.copy_room_frac` varies, over `seeds` traces (the bench
    runs seed 0 alone): hit rate of the oracle's and imbalance, mean and max, and seed 0's. Run
    it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_copy_room as s;
                             print(json.dumps(s(), indent=1))"
    (one line)."""
    return {str(room): _router_sim_points({"copy_room_frac": room}, seeds, 1500) for room in rooms}


def sweep_balance(seeds: int = 4, num_requests: int = 1500,
                  points: tuple[tuple[float, float], ...] = ((2.0, 0.0), (1.5, 0.0), (2.0, 0.25), (1.5, 0.25))
                  ) -> dict[str, Any]:
    """kv_aware in `kvmesh bench router --no-live`'s simulation (4, 8 and 16 workers) at each
    (`BoundedLoadFilter.holder_factor`, `PrefillCostScorer.tolerance_exponent`) of `points`, over
    `seeds` traces of `num_requests` (the bench: seed 0, 1,500 with --quick, 4,000 without): the
    figures `sweep_copy_room` gives. The defaults (1.5, 0.25) keep every size's imbalance within
    1.15 on the bench's traces (docs/routing.md); 2 workers, the live benches' size, are not
    changed by either. Run it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_balance as s;
                             print(json.dumps(s(), indent=1))"
    (one line; `s(seeds=1, num_requests=4000)` for the full bench's trace)."""
    return {f"holder_factor={h},tolerance_exponent={e}":
            _router_sim_points({"holder_factor": h, "tolerance_exponent": e}, seeds, num_requests)
            for h, e in points}


def _router_sim_points(fields: dict[str, float], seeds: int, num_requests: int) -> dict[str, Any]:
    """{workers: kv_aware's hit rate of the oracle's and imbalance (mean, max, seed 0's)} over
    `seeds` traces of the router bench's simulation with SimConfig `fields`."""
    row: dict[str, Any] = {}
    for n in (4, 8, 16):
        runs = []
        for seed in range(seeds):
            cfg = SimConfig(num_workers=n, num_requests=num_requests, seed=seed, **fields)  # type: ignore[arg-type]
            trace = make_trace(cfg)
            runs.append((simulate(RoutingPolicy.KV_AWARE, cfg, trace), oracle_hit_rate(cfg, trace)))
        vs, imb = [r.hit_rate / o for r, o in runs], [r.imbalance for r, _ in runs]
        row[str(n)] = {"hit_rate_vs_oracle": statistics.mean(vs), "imbalance": statistics.mean(imb),
                       "imbalance_max": max(imb), "seed0": {"hit_rate_vs_oracle": vs[0], "imbalance": imb[0]}}
    return row


def _sweep(field: str, values: tuple[float | None, ...], policies: tuple[RoutingPolicy, ...], quick: bool,
           seeds: int) -> dict[str, Any]:
    """{value: {scenario (or "scenario/policy" for several policies): figures averaged over
    `seeds` traces}} with SimConfig's `field` at each of `values`."""
    live = bench_live.QUICK if quick else bench_live.LiveConfig()
    out: dict[str, Any] = {}
    for value in values:
        row = out[str(value)] = {}
        for scenario in bench_live.SCENARIOS:
            for policy in policies:
                runs = [simulate_live_scenario(policy, live, scenario, seed, **{field: value})
                        for seed in range(seeds)]
                row[scenario if len(policies) == 1 else f"{scenario}/{policy.value}"] = {
                    "hit_rate": statistics.mean(r.hit_rate for r in runs),
                    "cold_requests": statistics.mean(r.cold_requests for r in runs),
                    "imbalance": statistics.mean(r.imbalance for r in runs)}
    return out


def sweep_fade(quick: bool = False, seeds: int = 10,
               steps: tuple[float | None, ...] = (None, 640.0, 128.0, 32.0, 8.0)) -> dict[str, Any]:
    """kv_aware and round robin over the simulated routing-live scenarios as the workers' pools'
    `fade_steps` (kvstore/fade.py: the mistakes — blocks evicted, then cached again — that move
    the protection's window by one pool size; None: the window fixed at `protect_turnovers`)
    varies: hit rate, cold requests and imbalance averaged over `seeds` traces. The default
    `FADE_STEPS` is the best kv_aware shift that costs the pressure scenario nothing at either
    size (docs/routing.md has the figures). Run it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_fade as s;
                             print(json.dumps(s(), indent=1))"
    (one line; the default sizes; `s(quick=True, seeds=20)` for the quick ones)."""
    return _sweep("fade_steps", steps, (RoutingPolicy.KV_AWARE, RoutingPolicy.ROUND_ROBIN), quick, seeds)


def sweep_live_holder_factor(quick: bool = False, seeds: int = 10,
                             factors: tuple[float, ...] = (2.0, 1.5)) -> dict[str, Any]:
    """kv_aware over the simulated routing-live scenarios (2 workers) as its holder allowance
    (`BoundedLoadFilter.holder_factor`) varies: what `sweep_balance`'s choice costs the live
    benches' size. Run it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_live_holder_factor as s;
                             print(json.dumps(s(), indent=1))"
    (one line; the default sizes; `s(quick=True, seeds=20)` for the quick ones)."""
    return _sweep("holder_factor", factors, (RoutingPolicy.KV_AWARE,), quick, seeds)


def sweep_prefix_hint(quick: bool = False, seeds: int = 10) -> dict[str, Any]:
    """kv_aware and round robin over the simulated routing-live scenarios without and with
    `SimConfig.prefix_hint` (the router tells the worker how many leading blocks other requests
    will share, `BlockIndex.shared_prefix`, and the pool protects them from their first use
    instead of their second): what the hint buys the shifts (docs/routing.md). Run it with
        .venv/bin/python -c "import json; from kvmesh.bench.routing_sweeps import sweep_prefix_hint as s;
                             print(json.dumps(s(), indent=1))"
    (one line; the default sizes; `s(quick=True, seeds=20)` for the quick ones)."""
    return _sweep("prefix_hint", (False, True), (RoutingPolicy.KV_AWARE, RoutingPolicy.ROUND_ROBIN), quick, seeds)
