"""`BlockIndex.check_integrity`'s structural checks: the holder map against the per-worker sets,
and the pending predictions against the requests that made them (a failure is a bug)."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import NamedTuple

from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash

ALL_TIERS = (1 << len(Tier)) - 1


class Pending(NamedTuple):
    """One request's prediction: the blocks it computes on `worker_id`, until `expires_at`;
    `asking`, while it runs (not settled), its whole prompt (held or computed there)."""

    worker_id: WorkerId
    hashes: tuple[BlockHash, ...]
    expires_at: float
    asking: tuple[BlockHash, ...] = ()


def check_holders(entries: Iterable[tuple[BlockHash, WorkerId, int]],
                  by_worker: Mapping[WorkerId, Collection[BlockHash]],
                  holders: Callable[[BlockHash], Collection[WorkerId]]) -> None:
    """Every (block, worker, tier mask) entry has a valid mask and is in the worker's set, and
    every block in a worker's set is in the map."""
    num_entries = 0
    for h, w, mask in entries:
        assert 0 < mask <= ALL_TIERS, f"block {h:032x} on {w} has tier mask {mask}"
        assert h in by_worker.get(w, ()), f"block {h:032x} lists {w} but {w}'s set lacks it"
        num_entries += 1
    for w, held in by_worker.items():
        for h in held:
            assert w in holders(h), f"{w}'s set has {h:032x} but the map does not"
    in_sets = sum(len(held) for held in by_worker.values())
    assert num_entries == in_sets, f"{num_entries} map entries != {in_sets} in worker sets"


def check_pending(pending: Mapping[BlockHash, Mapping[WorkerId, Collection[str]]], requests: Mapping[str, Pending],
                  requests_on: Mapping[WorkerId, int], holders: Callable[[BlockHash], Collection[WorkerId]],
                  asking: Mapping[BlockHash, Mapping[WorkerId, Collection[str]]]) -> None:
    """Each pending (block, worker) names requests that predict it there and is not also stored
    there, the per-worker request counts match the records, and every block a running request
    asks for (`asking`, its records' `asking`) is held or computed on its worker."""
    on: dict[WorkerId, int] = {}
    for record in requests.values():
        on[record.worker_id] = on.get(record.worker_id, 0) + 1
    assert on == requests_on, f"requests per worker {dict(requests_on)} != {on} recorded"
    for h, computing in pending.items():
        for w, rids in computing.items():
            assert rids, f"pending block {h:032x} on {w} has no request"
            assert w not in holders(h), f"block {h:032x} is both stored and pending on {w}"
            for rid in rids:
                p = requests.get(rid)
                assert p is not None and p.worker_id == w and h in p.hashes, \
                    f"pending block {h:032x} on {w} names {rid}, which does not predict it"
    for rid, record in requests.items():
        for h in record.asking:
            assert rid in asking.get(h, {}).get(record.worker_id, ()), f"{rid} asks for {h:032x}, unlisted"
            assert record.worker_id in holders(h) or record.worker_id in pending.get(h, {}), \
                f"{rid} asks for {h:032x} on {record.worker_id}, which neither holds nor computes it"
    for h, by_worker in asking.items():
        for w, rids in by_worker.items():
            assert rids and all(h in requests[r].asking and requests[r].worker_id == w for r in rids), \
                f"block {h:032x} on {w}: stale askers"
