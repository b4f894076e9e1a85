"""`kvmesh bench routing-live --repeats N`: each scenario's policies run N times, every other
round in reverse order (rr, kv, kv, rr, …), so a machine whose load drifts over a run slows the
policies alike rather than whichever ran last; a policy's entry is then the rounds combined.

Combined: the latencies, rates and fractions are the median over the rounds; cold requests too
(a float for an even N); the request counts (per worker, per prefix and worker, in all) and the
router's mismatches are summed, so `mismatch_rate` is all mismatches over all requests and the
busiest / idlest ratio is over every request sent. `repeats` lists each round's own figures
(with its `load_avg` and `cpu_s`), `diagnostics` holds the medians of the rounds' numeric
diagnostics and of each process's CPU seconds, and the pick log's classes combined
(`combine_pick_logs`).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvmesh.bench.routing_live_figures import combine_pick_logs

P = TypeVar("P")

MEDIAN_KEYS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "req_s", "output_tok_s", "cached_token_frac",
               "cold_requests", "wall_s")


def rounds(policies: Sequence[P], repeats: int, run: Callable[[P], dict[str, Any]]) -> dict[P, dict[str, Any]]:
    """`run(policy)` for every policy, `repeats` rounds, odd rounds in reverse order; each
    policy's entries combined (`combine`; one round: its entry as it is), in `policies` order."""
    got: dict[P, list[dict[str, Any]]] = {p: [] for p in policies}
    for r in range(repeats):
        for policy in (policies if r % 2 == 0 else policies[::-1]):
            got[policy].append(run(policy))
    return {p: entries[0] if len(entries) == 1 else combine(entries) for p, entries in got.items()}


def combine(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds as one entry (module docstring)."""
    out = dict(entries[0])
    for key in MEDIAN_KEYS:
        out[key] = statistics.median(e[key] for e in entries)
    out["requests"] = sum(e["requests"] for e in entries)
    out["requests_per_worker"] = _summed(e["requests_per_worker"] for e in entries)
    prefixes = sorted({k for e in entries for k in e["requests_per_worker_per_prefix"]}, key=int)
    out["requests_per_worker_per_prefix"] = {
        k: _summed(e["requests_per_worker_per_prefix"].get(k, {}) for e in entries) for k in prefixes}
    mismatches = sum(int(e["router"].get("hit_mismatches", 0)) for e in entries)
    routed = sum(max(1, int(e["router"].get("requests", 0))) for e in entries)
    out["mismatch_rate"] = mismatches / routed
    out["router"] = {"hit_mismatches": mismatches, "requests": routed}
    if "unavailable_retries" in out:
        out["unavailable_retries"] = sum(int(e.get("unavailable_retries", 0)) for e in entries)
    numeric = [k for k, v in entries[0]["diagnostics"].items() if isinstance(v, (int, float))]
    out["diagnostics"] = {k: statistics.median(e["diagnostics"][k] for e in entries
                                               if isinstance(e["diagnostics"].get(k), (int, float)))
                          for k in numeric}
    picks = [e["diagnostics"]["pick_log"] for e in entries if "pick_log" in e["diagnostics"]]
    if picks:   # the pick log's classes: requests summed, TTFT p50 the median of the rounds'
        out["diagnostics"]["pick_log"] = combine_pick_logs(picks)
    cpu = [e["diagnostics"]["cpu_s"] for e in entries if "cpu_s" in e["diagnostics"]]
    if cpu:     # each process's CPU seconds, the median over the rounds
        out["diagnostics"]["cpu_s"] = {name: statistics.median(c[name] for c in cpu if name in c)
                                       for name in sorted({n for c in cpu for n in c})}
    out["repeats"] = [{k: e[k] for k in (*MEDIAN_KEYS, "mismatch_rate", "requests_per_worker")}
                      | {k: e["diagnostics"].get(k) for k in ("load_avg", "cpu_s")} for e in entries]
    return out


def _summed(rows: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))
