"""Where blocks live: block hash → the workers holding it, and in which tiers.

Fed by the workers' KV event streams (`kvstore.streams.EventConsumer` calls `apply`,
`clear_worker`, `remove_worker`); read by the routing policy through `match_prefix`. In
memory only and torch-free. Not thread-safe: one event loop owns it (the consumer and the
policy run on the router's loop).

A worker may hold one block in several tiers at once (a device copy being offloaded to
host memory), so each (block, worker) entry is a set of tiers, kept as a bit mask; the
entry goes when its last tier goes. Removing a worker is O(its blocks): a per-worker set
of hashes mirrors the main map.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvstore.events import EventType, Tier, WireEvent, WorkerId
from kvstore.keys import BlockHash

_BIT = {tier: 1 << i for i, tier in enumerate(Tier)}  # Tier order: fastest first
_ALL_TIERS = (1 << len(Tier)) - 1


class IndexStats(NamedTuple):
    """`num_blocks`: distinct hashes held anywhere; `num_entries`: (hash, worker) pairs."""

    num_blocks: int
    num_entries: int
    num_workers: int
    events_applied: int


def _tiers(mask: int) -> frozenset[Tier]:
    return frozenset(tier for tier, bit in _BIT.items() if mask & bit)


class BlockIndex:
    """block hash → {worker_id: tiers}; see the module docstring."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, dict[WorkerId, int]] = {}
        self._by_worker: dict[WorkerId, set[BlockHash]] = {}
        self._applied = 0

    def apply(self, worker_id: WorkerId, event: WireEvent) -> None:
        """Apply one wire event of `worker_id` (its meaning: `kvstore.events`); the worker
        becomes known if it was not."""
        self._by_worker.setdefault(worker_id, set())
        kind = event.type
        if kind is EventType.STORED:
            self.add(worker_id, event.hashes, event.tier)
        elif kind is EventType.REMOVED:
            self.discard(worker_id, event.hashes, event.tier)
        elif kind is EventType.CLEARED:
            self._drop(worker_id, self._by_worker.get(worker_id, ()), _BIT[event.tier])
        elif kind is EventType.INVENTORY_BEGIN:
            self.clear_worker(worker_id)
        else:
            assert kind is EventType.INVENTORY_END, f"unknown event type {kind!r}"
        self._applied += 1

    def add(self, worker_id: WorkerId, hashes: Iterable[BlockHash], tier: Tier) -> None:
        """`worker_id` now holds `hashes` in `tier` (idempotent)."""
        bit = _BIT[tier]
        held = self._by_worker.setdefault(worker_id, set())
        for h in hashes:
            holders = self._blocks.setdefault(h, {})
            holders[worker_id] = holders.get(worker_id, 0) | bit
            held.add(h)

    def discard(self, worker_id: WorkerId, hashes: Iterable[BlockHash], tier: Tier) -> None:
        """`worker_id` no longer holds `hashes` in `tier` (unknown ones are ignored)."""
        self._drop(worker_id, hashes, _BIT[tier])

    def clear_worker(self, worker_id: WorkerId) -> None:
        """Forget every block of `worker_id`; it stays known (with no blocks)."""
        self._drop(worker_id, self._by_worker.get(worker_id, ()), _ALL_TIERS)
        self._by_worker[worker_id] = set()

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget `worker_id` altogether (it left routing)."""
        self._drop(worker_id, self._by_worker.get(worker_id, ()), _ALL_TIERS)
        self._by_worker.pop(worker_id, None)

    def match_prefix(self, block_hashes: Sequence[BlockHash],
                     workers: Iterable[str] | None = None) -> dict[str, int]:
        """For each of `workers` (default: every known worker), how many LEADING blocks of
        `block_hashes` it holds in any tier: the count stops at its first missing block.
        (Plain `str` ids: fits `router.routing.BlockIndexView`; the router reads WorkerId keys.)"""
        counts: dict[str, int] = {w: 0 for w in (self._by_worker if workers is None else workers)}
        matching = set(counts)
        num_matched = 0
        for h in block_hashes:
            holders = self._blocks.get(h)
            if holders is None:
                break
            missing = [w for w in matching if w not in holders]
            for w in missing:
                counts[w] = num_matched
                matching.discard(w)
            if not matching:
                break
            num_matched += 1
        for w in matching:
            counts[w] = num_matched
        return counts

    def locate(self, block_hash: BlockHash) -> dict[WorkerId, frozenset[Tier]]:
        """The workers holding `block_hash`, each with the tiers it holds it in."""
        return {w: _tiers(mask) for w, mask in self._blocks.get(block_hash, {}).items()}

    def holdings(self, worker_id: WorkerId) -> dict[BlockHash, frozenset[Tier]]:
        """Everything the index believes `worker_id` holds (a copy)."""
        return {h: _tiers(self._blocks[h][worker_id]) for h in self._by_worker.get(worker_id, ())}

    def workers(self) -> list[WorkerId]:
        """Known workers, sorted (including those with no blocks)."""
        return sorted(self._by_worker)

    def stats(self) -> IndexStats:
        return IndexStats(len(self._blocks), sum(len(h) for h in self._by_worker.values()),
                          len(self._by_worker), self._applied)

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        num_entries = 0
        for h, holders in self._blocks.items():
            assert holders, f"block {h:032x} has an empty holder map"
            for w, mask in holders.items():
                assert 0 < mask <= _ALL_TIERS, f"block {h:032x} on {w} has tier mask {mask}"
                assert h in self._by_worker.get(w, ()), \
                    f"block {h:032x} lists {w} but {w}'s set lacks it"
                num_entries += 1
        for w, held in self._by_worker.items():
            for h in held:
                assert w in self._blocks.get(h, {}), f"{w}'s set has {h:032x} but the map does not"
        by_worker = sum(len(held) for held in self._by_worker.values())
        assert num_entries == by_worker, f"{num_entries} map entries != {by_worker} in worker sets"

    def _drop(self, worker_id: WorkerId, hashes: Iterable[BlockHash], bits: int) -> None:
        held = self._by_worker.get(worker_id)
        if held is None:
            return
        for h in list(hashes):  # `hashes` may be `held` itself
            holders = self._blocks.get(h)
            if holders is None or worker_id not in holders:
                continue
            mask = holders[worker_id] & ~bits
            if mask:
                holders[worker_id] = mask
                continue
            del holders[worker_id]
            held.discard(h)
            if not holders:
                del self._blocks[h]
