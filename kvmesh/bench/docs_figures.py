"""The headline figures of each `kvmesh bench` result, against the baseline it measured in the
same run: one extractor per bench (what `kvmesh bench docs` renders). A figure missing from a
result renders as a dash; nothing here raises on a partial result."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["BENCHES", "EXTRACT", "Figure", "bench_of", "figures_of"]

BENCHES: dict[str, str] = {
    "engine": "kvmesh vs HF transformers `generate` (same weights, prompts, dtype) at batch 1 and 16; each "
    "against the roofline of the same workload measured on the machine in the same run; a cold "
    "1,024-token prefill against the measured matmul peak; worker metrics on vs off",
    "profile": "a batch-1 decode step with the native kernels vs `KVMESH_NATIVE_KERNELS=0` (torch), each in "
    "its own process: step time, the linear layers alone and the GB/s they stream",
    "prefix": "TTFT of a 1,024-token cached prefix + 32-token suffix vs the same prompt cold",
    "memory": "KV slots wasted by a varied-length workload, paged (block 16) vs contiguous at 1,024 tokens; "
    "sequences that fit in the same budget, per KV dtype",
    "accuracy": "perplexity on a real text and teacher-forced greedy agreement per KV dtype and token-eviction "
    "policy vs the fp32 cache",
    "transfer": "host-tier offload/onload vs a raw copy of the same bytes; peer transfer (gloo, 2 processes) vs "
    "one raw `torch.distributed` send; TTFT of a peer-held prefix fetched vs recomputed",
    "router": "simulated Zipf multi-tenant trace: each policy's hit rate vs an oracle pool and round robin at "
    "4/8/16 workers; routing-live's scenarios simulated; then (without `--no-live`) 3 live workers",
    "service": "closed-loop chat load through the router to 2 workers vs straight to 1 worker",
    "routing-live": "each policy on a fresh 2-worker cluster through the OpenAI HTTP API, with and without KV "
    "pressure, vs round robin in the same run",
    "chaos": "kill / partition schedule on a 3-worker `kvmesh serve` under load vs each prompt run once "
    "before any fault",
    "tenants": "alpha's short shared prompt every 0.3 s while beta floods long distinct prompts, on a 2-worker "
    "`kvmesh serve --api-keys-file`, with fair share and KV caps vs without, each vs alpha alone in the same run",
}


class Figure(NamedTuple):
    """One row: what was measured, the same-run baseline, and how they compare."""

    name: str
    value: str
    baseline: str
    versus: str


# -- number formatting ------------------------------------------------------------------------
def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _g(x: Any, unit: str = "", digits: int = 3) -> str:
    v = _num(x)
    if v is None:
        return "—"
    text = f"{v:.{digits}g}" if abs(v) < 10**digits else f"{v:,.0f}"
    return f"{text} {unit}".rstrip()


def _x(x: Any, word: str = "") -> str:
    v = _num(x)
    return "—" if v is None else f"{v:.2f}x{' ' + word if word else ''}"


def _pct(x: Any) -> str:
    v = _num(x)
    return "—" if v is None else f"{v * 100:+.2f}%"


def _ratio(a: Any, b: Any) -> float | None:
    va, vb = _num(a), _num(b)
    return va / vb if va is not None and vb else None


def _at(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


# -- one extractor per bench: (baseline in words, figures) -------------------------------------
Extract = Callable[[dict[str, Any]], tuple[str, list[Figure]]]


def _engine(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    out = []
    for batch, label in (("batch1", "batch 1"), ("batch16", "batch 16")):
        row = r.get(batch, {})
        out.append(
            Figure(
                f"{label} decode vs HF",
                _g(row.get("kvmesh_tok_s"), "tok/s"),
                _g(row.get("hf_tok_s"), "tok/s (HF)"),
                _x(row.get("speedup")),
            )
        )
        out.append(
            Figure(
                f"{label} vs roofline",
                _g(row.get("kvmesh_tok_s"), "tok/s"),
                _g(row.get("roofline_tok_s"), "tok/s (roofline)"),
                f"{_g(row.get('roofline_frac'))} of roofline",
            )
        )
    pre = r.get("prefill", {})
    out.append(
        Figure(
            "cold prefill vs matmul peak",
            _g(pre.get("gflop_s"), "GFLOP/s"),
            _g(_at(r, "roofline", "matmul_gflop_s"), "GFLOP/s (peak)"),
            f"{_g(pre.get('peak_frac'))} of peak",
        )
    )
    mc = r.get("metrics_cost", {})
    out.append(
        Figure(
            "batch 16 with metrics on vs off",
            _g(mc.get("on_tok_s"), "tok/s"),
            _g(mc.get("off_tok_s"), "tok/s (off)"),
            _x(mc.get("on_vs_off")),
        )
    )
    return "HF transformers and the measured rooflines, same run", out


def _profile(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    n, t, s = r.get("native", {}), r.get("torch", {}), r.get("speedup", {})
    return "the torch path (`KVMESH_NATIVE_KERNELS=0`), same run", [
        Figure(
            "batch-1 decode step",
            _g(n.get("step_ms"), "ms"),
            _g(t.get("step_ms"), "ms (torch)"),
            _x(s.get("step"), "faster"),
        ),
        Figure(
            "linear layers",
            _g(n.get("linear_ms"), "ms"),
            _g(t.get("linear_ms"), "ms (torch)"),
            _x(s.get("linear"), "faster"),
        ),
        Figure(
            "weight stream of the linear layers",
            _g(n.get("linear_gb_s"), "GB/s"),
            _g(t.get("linear_gb_s"), "GB/s (torch)"),
            _x(_ratio(n.get("linear_gb_s"), t.get("linear_gb_s"))),
        ),
        Figure(
            "rest of the step",
            _g(n.get("rest_ms"), "ms"),
            _g(t.get("rest_ms"), "ms (torch)"),
            _x(s.get("rest"), "faster"),
        ),
    ]


def _prefix(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    prefix = _at(r, "config", "prefix_tokens")
    return "the same prompts cold (prefix cache reset), same run", [
        Figure(
            f"TTFT, {prefix or '?'}-token cached prefix",
            _g(r.get("warm_ttft_s"), "s"),
            _g(r.get("cold_ttft_s"), "s (cold)"),
            _x(r.get("speedup"), "faster"),
        )
    ]


def _memory(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    out = [
        Figure(
            "KV slots wasted",
            _pct(r.get("paged_waste_frac")).lstrip("+"),
            _pct(r.get("contiguous_waste_frac")).lstrip("+") + " (contiguous)",
            "paged vs contiguous",
        ),
        Figure(
            "sequences in the budget",
            _g(r.get("paged_max_seqs")),
            _g(r.get("contiguous_max_seqs")) + " (contiguous)",
            _x(r.get("capacity_gain")),
        ),
    ]
    for dtype, row in (r.get("per_dtype") or {}).items():
        out.append(
            Figure(
                f"sequences in the budget, {dtype} KV",
                _g(row.get("max_seqs")),
                _g(_at(r, "per_dtype", "fp16", "max_seqs")) + " (fp16)",
                _x(row.get("capacity_vs_fp16")),
            )
        )
    return "a contiguous allocator reserving the full length; fp16 KV for the dtype rows", out


def _accuracy(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    rows = {k: v for k, v in r.items() if isinstance(v, dict) and "ppl" in v}
    names = list(rows)
    base = names[0] if names else "fp32"
    out = []
    for name in names[1:]:
        v = rows[name]
        out.append(
            Figure(
                f"{name}: perplexity",
                _g(v.get("ppl"), digits=5),
                _g(rows[base].get("ppl"), digits=5) + f" ({base})",
                f"{_pct(v.get('ppl_delta_frac'))}, agreement {_g(v.get('token_agreement'))}",
            )
        )
    return f"the {base} KV cache, same model and text, same run; " + str(_at(r, "notes", "text") or ""), out


def _transfer(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    off, peer, ttft = r.get("offload", {}), r.get("peer", {}), r.get("ttft", {})
    return "a raw copy / raw `torch.distributed` send of the same bytes; the prefix recomputed; same run", [
        Figure(
            "offload to the host tier",
            _g(off.get("offload_gb_s"), "GB/s"),
            _g(off.get("memcpy_gb_s"), "GB/s (memcpy)"),
            _x(off.get("offload_vs_memcpy")),
        ),
        Figure(
            "onload from the host tier",
            _g(off.get("onload_gb_s"), "GB/s"),
            _g(off.get("memcpy_gb_s"), "GB/s (memcpy)"),
            _x(off.get("onload_vs_memcpy")),
        ),
        Figure(
            "peer transfer",
            _g(peer.get("peer_gb_s"), "GB/s"),
            _g(peer.get("raw_gb_s"), "GB/s (raw send)"),
            _x(peer.get("peer_vs_raw")),
        ),
        Figure(
            f"TTFT, {ttft.get('prefix_tokens', '?')}-token peer-held prefix fetched",
            _g(ttft.get("fetched_s"), "s"),
            _g(ttft.get("recomputed_s"), "s (recomputed)"),
            _x(_ratio(ttft.get("recomputed_s"), ttft.get("fetched_s")), "faster"),
        ),
        Figure(
            "TTFT, the same prefix as a local hit",
            _g(ttft.get("local_hit_s"), "s"),
            _g(ttft.get("recomputed_s"), "s (recomputed)"),
            _x(_ratio(ttft.get("recomputed_s"), ttft.get("local_hit_s")), "faster"),
        ),
    ]


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
        return (
            f"TTFT p50 {_g(p.get('ttft_p50_s'), 's')}, {_g(p.get('req_s'))} req/s, "
            f"cached {_g(p.get('cached_token_frac'))}, "
            f"cold {_g(p.get('cold_requests'))} (min {_g(p.get('min_cold_requests'))})"
        )

    out = []
    for scenario in ("no_pressure", "pressure"):
        rows = r.get(scenario) or {}
        rr = rows.get("round_robin", {})
        for policy, p in rows.items():
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
    return "alpha alone on the same cluster; the unfair cluster for throughput", out


def _generic(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    return "as recorded in the file", [Figure(k, _g(v), "", "") for k, v in r.items() if _num(v) is not None]


EXTRACT: dict[str, Extract] = {
    "engine": _engine,
    "profile": _profile,
    "prefix": _prefix,
    "memory": _memory,
    "accuracy": _accuracy,
    "transfer": _transfer,
    "router": _router,
    "service": _service,
    "routing-live": _routing_live,
    "chaos": _chaos,
    "tenants": _tenants,
}


def bench_of(meta: dict[str, Any], result: dict[str, Any]) -> str:
    """The bench that wrote `result`: `meta.bench`, else recognised by its keys."""
    if meta.get("bench") in EXTRACT:
        return str(meta["bench"])
    keys = set(result)
    for bench, need in (
        ("engine", {"batch1", "batch16"}),
        ("prefix", {"warm_ttft_s"}),
        ("memory", {"paged_waste_frac"}),
        ("profile", {"native", "torch", "speedup"}),
        ("transfer", {"peer_vs_raw"}),
        ("router", {"simulation"}),
        ("service", {"router_2_workers"}),
        ("chaos", {"outputs_equal_frac"}),
        ("tenants", {"fair", "unfair"}),
    ):
        if need <= keys:
            return bench
    if keys & {"no_pressure", "pressure"}:
        return "routing-live"
    if any(isinstance(v, dict) and "ppl_delta_frac" in v for v in result.values()):
        return "accuracy"
    return "unknown"


def figures_of(bench: str, result: dict[str, Any]) -> tuple[str, list[Figure]]:
    """(the baseline in words, the headline figures) of `result`, written by `bench`."""
    return EXTRACT.get(bench, _generic)(result)
