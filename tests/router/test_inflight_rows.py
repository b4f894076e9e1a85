"""`InFlightPrefills.mean_column` keeps its worker → slot map between calls: a worker first
dispatched to after the map was built gets its slot patched in place (no rebuild per pick at
1,000 workers) and reads the same figure as a map built afresh."""
from __future__ import annotations

import functools

from router.index.compact import CompactBlockIndex
from router.routing.inflight import InFlightPrefills
from router.routing.types import RouteRequest, WorkerId


def test_the_mean_column_follows_workers_first_dispatched_to_after_it_was_built() -> None:
    ids = [WorkerId(f"w{i}") for i in range(6)]
    route = RouteRequest((1, 2, 3), ())
    for key in (ids, [*ids, ids[2]]):       # the second names a worker twice: its map is rebuilt instead
        now = [0.0]
        clock = functools.partial(now.__getitem__, 0)
        kept, fresh = InFlightPrefills(clock=clock), InFlightPrefills(clock=clock)
        index = CompactBlockIndex()
        assert kept.mean_column(key).tolist() == [0.0] * len(key)
        built = kept._rows[0]
        for step, w in enumerate([ids[3], ids[0], ids[3], ids[5], ids[2]]):
            for p in (kept, fresh):
                p.dispatched(index, f"r{step}-{id(p)}", w, route, 0)
            now[0] += 1.5
            fresh.mean_column(list(reversed(key)))        # so that its next map is built afresh
            got = kept.mean_column(key).tolist()
            assert got == fresh.mean_column(key).tolist(), (step, key)
            assert got[key.index(w)] > 0.0
            if len(set(key)) == len(key):
                assert kept._rows[0] is built           # patched, not rebuilt
