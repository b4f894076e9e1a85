"""Figure extractors of the benches on a cluster (router, service, routing-live, chaos, tenants):
each takes a result and returns (the baseline in words, the headline figures)."""

from __future__ import annotations

from typing import Any

from kvmesh.bench.docs_figures_fmt import Extract, Figure, _at, _g, _num, _ratio, _x


def _router(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    sim = r.get("simulation", {})
    out = []
    by = sim.get("by_workers", {})
    for n in sorted(by, key=int):
        row = by[n]
        for policy in ("kv_aware", "prefix_hash", "least_loaded", "round_robin"):
            p = row.get(policy)
            if isinstance(p, dict):
                out.append(
                    Figure(
                        f"{n} workers, {policy}: hit rate (imbalance {_g(p.get('imbalance'))})",
                        _g(p.get("hit_rate")),
                        _g(row.get("oracle_hit_rate")) + " (oracle)",
                        f"{_g(p.get('hit_rate_vs_oracle'))} of oracle",
                    )
                )
    for scenario, rows in (sim.get("live_scenarios") or {}).items():
        if scenario == "config" or not isinstance(rows, dict):
            continue
        kv, rr = rows.get("kv_aware", {}), rows.get("round_robin", {})
        out.append(
            Figure(
                f"routing-live's {scenario} simulated: kv_aware cold requests "
                f"(minimum {kv.get('min_cold_requests', '?')})",
                _g(kv.get("cold_requests")),
                _g(rr.get("cold_requests")) + " (round_robin)",
                f"hit rate {_g(kv.get('hit_rate'))} vs {_g(rr.get('hit_rate'))}",
            )
        )
    live = r.get("live") or {}
    rr_live = _at(live, "round_robin", "cached_token_frac")
    for policy, row in live.items():
        if policy != "config" and isinstance(row, dict):
            out.append(
                Figure(
                    f"live, {policy}: cached prompt-token fraction",
                    _g(row.get("cached_token_frac")),
                    _g(rr_live) + " (round_robin)",
                    _x(_ratio(row.get("cached_token_frac"), rr_live)),
                )
            )
    return "an oracle pool holding every prefix, and round robin, on the same trace", out


def _service(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    a, b = r.get("router_2_workers", {}), r.get("direct_1_worker", {})
    return "the same load straight to one worker, same run", [
        Figure(
            "requests/s through the router (2 workers)",
            _g(a.get("requests_per_s")),
            _g(b.get("requests_per_s")) + " (direct)",
            _x(_ratio(a.get("requests_per_s"), b.get("requests_per_s"))),
        ),
        Figure(
            "TTFT p50",
            _g(a.get("ttft_p50_s"), "s"),
            _g(b.get("ttft_p50_s"), "s (direct)"),
            _x(_ratio(a.get("ttft_p50_s"), b.get("ttft_p50_s"))),
        ),
        Figure(
            "TTFT p99",
            _g(a.get("ttft_p99_s"), "s"),
            _g(b.get("ttft_p99_s"), "s (direct)"),
            _x(_ratio(a.get("ttft_p99_s"), b.get("ttft_p99_s"))),
        ),
    ]


def _routing_live(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    def cell(p: dict[str, Any]) -> str:
        per_worker = sorted((p.get("requests_per_worker") or {}).values())
        spread = f", busiest/idlest {_g(_ratio(per_worker[-1], per_worker[0]))}" if per_worker else ""
        # a run from before the key has none: nothing shown
        ceiling = f" (ceiling {_g(p['max_cached_token_frac'])})" if "max_cached_token_frac" in p else ""
        return (
            f"TTFT p50 {_g(p.get('ttft_p50_s'), 's')}, {_g(p.get('req_s'))} req/s, "
            f"cached {_g(p.get('cached_token_frac'))}{ceiling}, "
            f"cold {_g(p.get('cold_requests'))} (min {_g(p.get('min_cold_requests'))}), "
            f"mismatch {_g(p.get('mismatch_rate'))}{spread}"
        )

    out = []
    for scenario in ("no_pressure", "pressure", "shift"):
        rows = r.get(scenario) or {}
        rr = rows.get("round_robin", {})
        for policy, p in sorted(rows.items(), key=lambda kv: kv[0] != "kv_aware"):   # the default policy first
            if policy == "round_robin" or not isinstance(p, dict):
                continue
            cached = _num(p.get("cached_token_frac"))
            cached_rr = _num(rr.get("cached_token_frac"))
            points = (
                f"{(cached - cached_rr) * 100:+.1f} points cached"
                if cached is not None and cached_rr is not None
                else "—"
            )
            out.append(
                Figure(
                    f"{scenario.replace('_', ' ')}: {policy}",
                    cell(p),
                    cell(rr) if rr else "—",
                    f"req/s {_x(_ratio(p.get('req_s'), rr.get('req_s')))}, "
                    f"TTFT p50 {_x(_ratio(p.get('ttft_p50_s'), rr.get('ttft_p50_s')))}, {points}",
                )
            )
    return "round robin on the same workload, same run", out


def _chaos(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    out = [
        Figure(
            "requests completed",
            _g(r.get("completed")),
            _g(r.get("requests")) + " sent",
            f"failed {_g(r.get('failed'))}, hung {_g(r.get('hung'))}, migrated {_g(r.get('migrated'))}",
        ),
        Figure("outputs equal to the fault-free run", _g(r.get("outputs_equal_frac")), "1 (fault-free)", ""),
    ]
    for fault, rec in (r.get("recovery_s") or {}).items():
        if isinstance(rec, dict):
            out.append(Figure(f"recovery: {fault}", ", ".join(f"{k} {_g(v, 's')}" for k, v in rec.items()), "", ""))
    return "each prompt once through the same cluster before any fault", out


def _tenants(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    out = []
    for mode in ("fair", "unfair"):
        m = r.get(mode) or {}
        alone, flood = m.get("alone") or {}, m.get("flood") or {}
        out.append(Figure(f"{mode}: alpha TTFT p90 during the flood", _g(flood.get("ttft_p90_s"), "s"),
                          _g(alone.get("ttft_p90_s"), "s") + " alone", _x(m.get("alpha_ttft_p90_ratio"))))
        out.append(Figure(f"{mode}: alpha cached fraction during the flood", _g(flood.get("cached_frac")),
                          _g(alone.get("cached_frac")) + " alone", _x(m.get("alpha_cached_frac_ratio"))))
        out.append(Figure(f"{mode}: output tok/s (both tenants)", _g(m.get("output_tok_s")), "", ""))
    fair = r.get("fair") or {}
    out.append(Figure("fair ÷ unfair output tok/s", _x(fair.get("throughput_ratio")), "1 (unfair)", ""))
    out.append(Figure("fair ÷ unfair flood tok/s (beta's prompt + output tokens)", _x(fair.get("flood_tok_s_ratio")),
                      "1 (unfair)", ""))
    return "alpha alone on the same cluster; the unfair cluster for throughput", out


def _scale(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    legacy = {run.get("workers"): run for run in (r.get("baseline") or {}).get("legacy", [])}
    out = []
    # the largest size first: the targets are set for 1,000 workers (the README shows the first row)
    for run in sorted(r.get("runs", []), key=lambda x: -(_num(x.get("workers")) or 0)):
        n, old = run.get("workers"), legacy.get(run.get("workers"), {})
        out.append(Figure(f"{n} workers ({_g(run.get('blocks'))} blocks): decision p50 / p99",
                          f"{_g(run.get('decision_p50_ms'))} / {_g(run.get('decision_p99_ms'))} ms",
                          f"{_g(old.get('decision_p99_ms'))} ms p99 (legacy index, dict pick)", "target p99 <= 2 ms"))
        out.append(Figure(f"{n} workers: event lag p99; index bytes per (block, worker) entry",
                          f"{_g(run.get('event_lag_p99_ms'))} ms; {_g(run.get('index_bytes_per_entry'))} B",
                          f"{_g(old.get('index_bytes_per_entry'))} B (legacy index)",
                          _x(_ratio(run.get("index_bytes_per_entry"), old.get("index_bytes_per_entry")))))
        d: dict[str, Any] = next((x for x in r.get("details", [])
                                  if x.get("workers") == n and x.get("index") == r.get("index")), {})
        if "dispatch_p99_ms" in d:
            out.append(Figure(f"{n} workers: a routed request's bookkeeping after its pick, p50 / p99",
                              f"{_g(d.get('dispatch_p50_ms'))} / {_g(d.get('dispatch_p99_ms'))} ms", "", ""))
        out.append(Figure(f"{n} workers: events/s per router core; Redis CPU, memory",
                          f"{_g(run.get('events_per_s_per_core'))}; {_g(run.get('redis_cpu_frac'))}, "
                          f"{_g((_num(run.get('redis_mem_bytes')) or 0) / 2**20)} MiB", "", ""))
    out.append(Figure(f"first bottleneck: {r.get('bottleneck', '—')}", "", "", ""))
    return "the same run with the legacy (dict-per-block) index and the dict-per-worker pick", out


CLUSTER_EXTRACT: dict[str, Extract] = {
    "router": _router,
    "service": _service,
    "routing-live": _routing_live,
    "chaos": _chaos,
    "tenants": _tenants,
    "scale": _scale,
}
