"""`kvmesh bench routing-live --routers N`: how much router replicas lose against one router on
the same workload, and how much sharing pending blocks (`kvmesh router --share-pending`,
router/routing/replicas.py) wins back.

One policy's entry becomes `{"routers": N, "one_router": {...}, "replicas": {...},
"replicas_shared": {...}, "gap": {...}}`: the three runs' routing-live figures (a fresh cluster
each, the same request sequence) and, per variant, the differences that matter here against
one router: `cached_token_frac` (served from cache), `cold_requests`, `mismatch_rate`
(requests whose predicted hit differed from the served one) and `prediction_error_mean`
(|predicted − served hit tokens| / prompt tokens, the mean of `kvmesh:router_hit_prediction_error`
over every router's requests).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

VARIANTS = (("one_router", False), ("replicas", False), ("replicas_shared", True))
COMPARED = ("cached_token_frac", "cold_requests", "mismatch_rate", "prediction_error_mean")


def compare_replicas(routers: int, run: Callable[[int, tuple[str, ...]], dict[str, Any]]) -> dict[str, Any]:
    """`run(number of routers, extra router flags)` for each variant; the entry described above."""
    out: dict[str, Any] = {"routers": routers}
    for name, shared in VARIANTS:
        figures = run(1 if name == "one_router" else routers, ("--share-pending",) if shared else ())
        figures["prediction_error_mean"] = prediction_error_mean(figures["router"])
        out[name] = figures
    base = out["one_router"]
    out["gap"] = {name: {k: out[name][k] - base[k] for k in COMPARED} for name, _ in VARIANTS[1:]}
    return out


def prediction_error_mean(router: dict[str, Any]) -> float:
    """The mean |predicted − served| / prompt tokens of the finished requests (0 without any)."""
    count = int(router.get("prediction_error_count", 0))
    return float(router.get("prediction_error_sum", 0.0)) / count if count else 0.0
