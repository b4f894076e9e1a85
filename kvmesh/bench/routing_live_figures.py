"""The figures of one `kvmesh bench routing-live` run (kvmesh/bench/routing_live.py) from what its
client saw: per request, its worker, TTFT, inter-token gaps and cached tokens (`_Served`); per
policy, the keys the bench's JSON promises (`summarize`) and what its TTFT is made of
(`diagnostics`: cold vs warm, the prefills a warm request shared its worker's steps with, the
requests in flight per worker over time); and, from the router's pick log, what each request's
worker held and had queued when it was picked (`pick_log_figures`)."""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class _Sized(Protocol):
    """What `summarize` reads of the bench's `LiveConfig`."""

    @property
    def prefix_tokens(self) -> int: ...


BLOCK_SIZE = 16     # the model's KV block, in tokens: a prompt's cached prefix is whole blocks


@dataclass(slots=True)
class _Served:
    prefix: int
    worker_id: str
    start: float
    end: float
    ttft_s: float
    itls: list[float]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def summarize(cfg: _Sized, num_prefixes: int, served: list[_Served], wall_s: float,
              router: dict[str, Any]) -> dict[str, Any]:
    """One policy's figures (the keys `routing-live` promises) from what the client saw."""
    full_prefix = cfg.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    ttfts = sorted(s.ttft_s for s in served)
    itls = sorted(x for s in served for x in s.itls)
    per: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for s in served:
        row = per.setdefault(str(s.prefix), {})
        row[s.worker_id] = row.get(s.worker_id, 0) + 1
        totals[s.worker_id] = totals.get(s.worker_id, 0) + 1
    prompt = sum(s.prompt_tokens for s in served)
    requests = max(1, int(router.get("requests", 0)))
    asked = {s.prefix for s in served}
    return {
        "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": _quantile(ttfts, 0.99),
        "itl_p50_s": statistics.median(itls) if itls else 0.0,
        "req_s": len(served) / wall_s, "output_tok_s": sum(s.completion_tokens for s in served) / wall_s,
        "cached_token_frac": sum(s.cached_tokens for s in served) / prompt if prompt else 0.0,
        "max_cached_token_frac": best_cached_tokens(served, full_prefix) / prompt if prompt else 0.0,
        "cold_requests": sum(s.cached_tokens < full_prefix for s in served),
        # each prefix the requests asked for computed once: a phase's draw may leave one out
        "min_cold_requests": min(num_prefixes, len(asked)),
        "requests_per_worker_per_prefix": {k: dict(sorted(v.items()))
                                           for k, v in sorted(per.items(), key=lambda kv: int(kv[0]))},
        "requests_per_worker": dict(sorted(totals.items())),
        "mismatch_rate": int(router.get("hit_mismatches", 0)) / requests,
        "wall_s": wall_s, "requests": len(served),
        "diagnostics": diagnostics(served, full_prefix), "router": router,
    }


def best_cached_tokens(served: Iterable[_Served], full_prefix: int) -> int:
    """The prompt tokens a perfect router would serve from cache: every request but the first of
    its prefix finds the prefix's full blocks (the engine recomputes at least a prompt's last
    token, so at most its whole blocks before that); the first computes it. The ceiling of
    `cached_token_frac` on a fresh cluster, or on pools full of other prefixes (`shift`)."""
    seen: set[int] = set()
    best = 0
    for s in sorted(served, key=lambda s: s.start):
        if s.prefix in seen:
            best += min(full_prefix, (s.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
        seen.add(s.prefix)
    return best


def diagnostics(served: list[_Served], full_prefix: int) -> dict[str, Any]:
    """What TTFT is made of: cold vs warm requests, how many other prefills each warm request
    shared its worker's steps with (mean), and how evenly the requests in flight were spread
    over the workers over time (time-averaged in flight per worker, its max / mean)."""
    cold = [s.ttft_s for s in served if s.cached_tokens < full_prefix]
    warm = [s.ttft_s for s in served if s.cached_tokens >= full_prefix]
    t0, t1 = min(s.start for s in served), max(s.end for s in served)
    area: dict[str, float] = {}
    for s in served:
        area[s.worker_id] = area.get(s.worker_id, 0.0) + (s.end - s.start)
    mean_in_flight = {w: a / (t1 - t0) for w, a in sorted(area.items())} if t1 > t0 else {}
    avg = sum(mean_in_flight.values()) / len(mean_in_flight) if mean_in_flight else 0.0
    warm_served = [s for s in served if s.cached_tokens >= full_prefix]
    return {"ttft_p50_cold_s": statistics.median(cold) if cold else None,
            "ttft_p50_warm_s": statistics.median(warm) if warm else None,
            "warm_prefill_overlap": (statistics.mean(_prefill_overlap(s, served) for s in warm_served)
                                     if warm_served else None),
            "mean_in_flight_per_worker": mean_in_flight,
            "in_flight_imbalance": max(mean_in_flight.values()) / avg if avg else None}


def _prefill_overlap(one: _Served, served: list[_Served]) -> int:
    """Other requests on `one`'s worker waiting for their first token while it waited for its
    own: the prefills it shared steps with (what a burst of arrivals on one worker costs)."""
    t0, t1 = one.start, one.start + one.ttft_s
    return sum(1 for s in served if s is not one and s.worker_id == one.worker_id
               and s.start < t1 and s.start + s.ttft_s > t0)


PICK_CLASSES = ("cold", "peer_fetched", "warm_queued", "warm_idle")


def pick_log_figures(lines: Iterable[str], full_prefix: int, since: float = 0.0) -> dict[str, dict[str, Any]]:
    """The requests picked at or after `since` (Unix time) in a router's pick log
    (router/observe/picklog.py), by what they met (the worker of each one's last pick, the one
    it finished on): `cold` (computed its prefix: cached tokens short of `full_prefix`),
    `peer_fetched` (fetched it from a peer), `warm_queued` (its worker held it and had a prefill
    queued: requests sent there that had not started streaming), `warm_idle` (held, none
    queued); per class the requests and the router's TTFT p50 (None without any). A line that
    is not JSON (a router killed mid-write leaves its last one cut) is skipped."""
    picks: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {c: [] for c in PICK_CLASSES}
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "pick":
            picks[e["request_id"]] = e
        elif e.get("event") == "finish" and "ttft_s" in e:
            pick = picks.get(e["request_id"])
            if pick is None or pick["t"] < since:
                continue
            if e["peer_cached_tokens"] > 0:
                kind = "peer_fetched"
            elif e["cached_tokens"] < full_prefix:
                kind = "cold"
            else:
                at = pick["workers"].get(pick["worker"], {})
                kind = "warm_queued" if at.get("queued_tokens", 0) > 0 else "warm_idle"
            ttfts[kind].append(e["ttft_s"])
    return {c: {"requests": len(v), "ttft_p50_s": statistics.median(v) if v else None} for c, v in ttfts.items()}


def combine_pick_logs(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """`pick_log_figures` of several rounds as one: the requests summed, the TTFT p50 the
    median of the rounds' (those with any)."""
    out = {}
    for c in PICK_CLASSES:
        p50s = [r[c]["ttft_p50_s"] for r in rounds if r[c]["ttft_p50_s"] is not None]
        out[c] = {"requests": sum(r[c]["requests"] for r in rounds),
                  "ttft_p50_s": statistics.median(p50s) if p50s else None}
    return out


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an ascending list."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]
