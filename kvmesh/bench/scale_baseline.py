"""`kvmesh bench scale`'s baseline variants, kept so that one run measures before and after.

`compact-per-pick`: the router's decision path before the live workers' columns were kept
between decisions (router/workers/live.py): `rebuild_per_pick` makes the registry build them
afresh at every pick — the walk over every entry (the live list, ids, slots, a numpy column per
figure, the decode pool, the peers) that `routing_view` did per request.

`compact-asks-loop`: the router as it is but for a routed prompt's asks counted holder by
holder — two `TallyTable.count` calls per (block, holder), as before `TallyTable.move` — which
at 1,000 workers, a popular prefix held by hundreds, made each request's bookkeeping after its
pick (`InFlightPrefills.dispatched` → `BlockIndex.add_pending`) cost several times the pick.

`compact-tracked`: router/index/compact.py's storage as it was
before the index moved out of the garbage collector's sight.

The same packed one-holder ints, but each worker's blocks in a `set` and a block with two or
more holders as a `{worker_id: tier mask}` dict value in the map itself: the map and every set
are tracked, so each full collection traverses every (block, worker) entry. Its queries and
events are `CompactBlockIndex`'s; only the storage of shared blocks and per-worker sets differs.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash
from router.index.asks import Ask, TallyTable
from router.index.compact import _BIT, _MASK, _SHIFT, CompactBlockIndex
from router.workers.live import LiveColumns
from router.workers.registry import WorkerRegistry


def rebuild_per_pick(registry: WorkerRegistry) -> None:
    """`registry.live_columns()` builds the columns at every call (module docstring)."""
    registry.live_columns = lambda: LiveColumns(registry.live())  # type: ignore[method-assign]


class _LoopTallyTable(TallyTable):
    """`TallyTable` whose `move` is the per-holder calls it replaced (module docstring)."""

    def move(self, keys: Collection[WorkerId], old: Ask | None, old_weight: float, new: Ask,
             new_weight: float) -> None:
        if old is not None:
            for key in keys:
                self.count(key, old, old_weight, -1)
        for key in keys:
            self.count(key, new, new_weight, +1)


class AsksLoopIndex(CompactBlockIndex):
    """`CompactBlockIndex` counting a routed prompt's asks holder by holder (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._held_asks = _LoopTallyTable()


class TrackedCompactIndex(CompactBlockIndex):
    """`CompactBlockIndex` with sets and dict values, as it was (module docstring)."""

    def _new_held(self) -> set[BlockHash]:  # type: ignore[override]
        return set()

    def add(self, worker_id: WorkerId, hashes: Iterable[BlockHash], tier: Tier) -> None:
        bit = _BIT[tier]
        held: Any = self._by_worker.setdefault(worker_id, set())  # type: ignore[arg-type]
        slot = self._slot(worker_id)
        base, canon, confirm = slot << _SHIFT, self._canon, self._pending.confirm
        blocks: dict[BlockHash, Any] = self._blocks
        for h in hashes:
            v = blocks.get(h)
            if v is None:
                blocks[h] = canon[base | bit]
                self._count_any(h, +1)
            elif type(v) is int:
                if v >> _SHIFT == slot:
                    blocks[h] = canon[v | bit]
                else:
                    blocks[h] = {self._slot_ids[v >> _SHIFT]: v & _MASK, worker_id: bit}
            else:
                v[worker_id] = v.get(worker_id, 0) | bit
            if h not in held:
                held.add(h)
                self._count_held(worker_id, h, +1)
            confirm(worker_id, h)

    def _masks(self, h: BlockHash) -> dict[WorkerId, int]:
        v: Any = self._blocks.get(h)
        if type(v) is int:
            return {self._slot_ids[v >> _SHIFT]: v & _MASK}  # type: ignore[dict-item]
        return v if v is not None else {}

    def _holders(self, h: BlockHash) -> Collection[WorkerId]:
        v: Any = self._blocks.get(h)
        if type(v) is int:
            return (self._slot_ids[v >> _SHIFT],)  # type: ignore[return-value]
        return v if v is not None else ()

    def _entries(self) -> Iterator[tuple[BlockHash, WorkerId, int]]:
        for h, v in self._blocks.items():
            if type(v) is int:
                yield h, self._slot_ids[v >> _SHIFT], v & _MASK  # type: ignore[misc]
            else:
                yield from ((h, w, mask) for w, mask in v.items())  # type: ignore[attr-defined]

    def _drop(self, worker_id: WorkerId, hashes: Iterable[BlockHash], bits: int, evicted: bool = True) -> None:
        held: Any = self._by_worker.get(worker_id)
        slot = self._slots.get(worker_id)
        if held is None or slot is None:
            return
        blocks: dict[BlockHash, Any] = self._blocks
        for h in list(hashes):
            v = blocks.get(h)
            if v is None:
                continue
            if type(v) is int:
                if v >> _SHIFT != slot:
                    continue
                mask = v & _MASK & ~bits
                if mask:
                    blocks[h] = self._canon[(slot << _SHIFT) | mask]
                    continue
                del blocks[h]
                last = True
            else:
                had = v.get(worker_id)
                if had is None:
                    continue
                if had & ~bits:
                    v[worker_id] = had & ~bits
                    continue
                del v[worker_id]
                if len(v) == 1:
                    ((other, other_mask),) = v.items()
                    blocks[h] = self._canon[(self._slots[other] << _SHIFT) | other_mask]
                last = False
            held.discard(h)
            self._count_held(worker_id, h, -1)
            self._pending.lost(worker_id, h, evicted)
            if last:
                self._count_any(h, -1)
                self._forget_asks(h)
