"""What the per-bench extractors of `kvmesh bench docs` return (`Figure`) and the number formatting
they share (`kvmesh/bench/docs_figures_engine.py`, `kvmesh/bench/docs_figures_cluster.py`): a value
missing from a result, or not a finite number, formats as a dash."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Extract", "Figure", "_at", "_g", "_num", "_pct", "_ratio", "_x"]


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
