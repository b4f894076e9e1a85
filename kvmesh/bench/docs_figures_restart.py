"""Figure extractor of `kvmesh bench restart` (kvmesh/bench/restart.py): the cached-token
fraction after a kill -9, a drain and a scale-out, with the disk tier + hand-over + warm start
and without them, in the same run."""

from __future__ import annotations

from typing import Any

from kvmesh.bench.docs_figures_fmt import Extract, Figure, _at, _g, _x


def _restart(r: dict[str, Any]) -> tuple[str, list[Figure]]:
    on, off = r.get("with") or {}, r.get("without") or {}
    t = r.get("targets") or {}
    rows = (("after kill -9 and restart: cached fraction after ÷ before", ("restart", "cached_ratio"), "restart"),
            ("the same, from the moment the restarted worker serves", ("restart", "cached_ratio_after_ready"), None),
            ("after a SIGTERM drain (scale in)", ("drain", "cached_ratio"), "drain"),
            ("scale-out: the new worker's first 20 requests ÷ the cluster before",
             ("scale_out", "first20_cached_ratio"), "scale_out_first20"))
    out = [Figure(name, _x(_at(on, *path)), _x(_at(off, *path)) + " without",
                  f"target >= {_g(t.get(target))}x" if target else "") for name, path, target in rows]
    hits = (("restarted worker's first cached request after it serves", ("restart", "first_hit_after_ready_s")),
            ("drain: first cached request on the remaining worker", ("drain", "first_hit_s")),
            ("new worker's first cached request after it serves", ("scale_out", "first_hit_s")))
    for name, path in hits:
        out.append(Figure(name, _g(_at(on, *path), "s"), _g(_at(off, *path), "s") + " without", ""))
    out.append(Figure("failed requests", _g(on.get("errors")), _g(off.get("errors")) + " without", ""))
    return (f"the same cluster without the disk tier, the drain hand-over and the warm start, same run "
            f"({_g(r.get('window_s'), 's')} windows)"), out


RESTART_EXTRACT: dict[str, Extract] = {"restart": _restart}
