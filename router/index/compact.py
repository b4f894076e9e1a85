"""`CompactBlockIndex`: the block index with a compact holder table, for large clusters.

Same contract as `router.index.blocks.BlockIndex` (it subclasses it; every query, event and
pending-block rule is the base class's), different storage of the block → holders map. The
base class keeps one dict per block (`{worker_id: tier mask}`, ~224 bytes even for one holder);
here a block held by ONE worker — nearly every block but the shared prefixes — maps to one int,
`slot << 3 | tier mask`, `slot` the worker's small integer number. Those ints are canonical
(one object per value, kept in `_canon`), so such an entry costs the map's slot, the key and
the per-worker set's slot: ~120–140 bytes per (block, worker) entry against ~340 in the base
class (`kvmesh bench scale` measures both). A block with two or more holders keeps the base
class's dict; it returns to an int when one holder is left.

Slots are numbered from 0 and reused once a worker is removed (`remove_worker`). Not
thread-safe, like the base class.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash
from router.index.asks import ASK_HALF_LIFE
from router.index.blocks import BlockIndex

_BIT = {tier: 1 << i for i, tier in enumerate(Tier)}   # as in blocks.py: fastest first
_SHIFT = len(Tier)
_MASK = (1 << _SHIFT) - 1


def _tiers(mask: int) -> frozenset[Tier]:
    return frozenset(tier for tier, bit in _BIT.items() if mask & bit)


class CompactBlockIndex(BlockIndex):
    """`BlockIndex` with one-holder blocks packed into canonical ints (module docstring)."""

    def __init__(self, *, fed: bool = True, ask_half_life: float = ASK_HALF_LIFE) -> None:
        super().__init__(fed=fed, ask_half_life=ask_half_life)
        # values: a packed int (one holder) or {worker_id: mask} (two or more)
        self._blocks: dict[BlockHash, int | dict[WorkerId, int]] = {}  # type: ignore[assignment]
        self._slots: dict[WorkerId, int] = {}
        self._slot_ids: list[WorkerId | None] = []
        self._free_slots: list[int] = []
        self._canon: list[int] = []       # _canon[v] is v: one object per packed value

    def _slot(self, worker_id: WorkerId) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_ids[slot] = worker_id
            else:
                slot = len(self._slot_ids)
                self._slot_ids.append(worker_id)
                self._canon.extend(range(len(self._canon), (slot + 1) << _SHIFT))
            self._slots[worker_id] = slot
        return slot

    def add(self, worker_id: WorkerId, hashes: Iterable[BlockHash], tier: Tier) -> None:
        bit = _BIT[tier]
        held = self._by_worker.setdefault(worker_id, set())
        slot = self._slot(worker_id)
        base, canon, blocks, confirm = slot << _SHIFT, self._canon, self._blocks, self._pending.confirm
        for h in hashes:
            v = blocks.get(h)
            if v is None:
                blocks[h] = canon[base | bit]
                self._count_any(h, +1)
            elif type(v) is int:
                if v >> _SHIFT == slot:
                    blocks[h] = canon[v | bit]
                else:
                    other = self._slot_ids[v >> _SHIFT]
                    assert other is not None, f"block {h:032x} names a free slot"
                    blocks[h] = {other: v & _MASK, worker_id: bit}
            else:
                assert isinstance(v, dict)
                v[worker_id] = v.get(worker_id, 0) | bit
            if h not in held:
                held.add(h)
                self._count_held(worker_id, h, +1)
            confirm(worker_id, h)    # the prediction is now a stored block

    def remove_worker(self, worker_id: WorkerId) -> None:
        super().remove_worker(worker_id)
        slot = self._slots.pop(worker_id, None)
        if slot is not None:          # no packed value names it any more: its blocks are gone
            self._slot_ids[slot] = None
            self._free_slots.append(slot)

    def _masks(self, h: BlockHash) -> dict[WorkerId, int]:
        v = self._blocks.get(h)
        if v is None:
            return {}
        if type(v) is int:
            w = self._slot_ids[v >> _SHIFT]
            assert w is not None, f"block {h:032x} names a free slot"
            return {w: v & _MASK}
        assert isinstance(v, dict)
        return v

    def _holders(self, h: BlockHash) -> Collection[WorkerId]:
        v = self._blocks.get(h)
        if v is None:
            return ()
        if type(v) is int:
            return (self._slot_ids[v >> _SHIFT],)  # type: ignore[return-value]
        assert isinstance(v, dict)
        return v

    def _entries(self) -> Iterator[tuple[BlockHash, WorkerId, int]]:
        for h, v in self._blocks.items():
            if type(v) is int:
                assert v is self._canon[v], f"block {h:032x}: packed value {v} is not the canonical int"
                w = self._slot_ids[v >> _SHIFT]
                assert w is not None and self._slots.get(w) == v >> _SHIFT, f"block {h:032x} names a free slot"
                yield h, w, v & _MASK
            else:
                assert isinstance(v, dict)
                assert len(v) >= 2, f"block {h:032x} keeps a holder map of {len(v)}"
                for w, mask in v.items():
                    yield h, w, mask

    def _drop(self, worker_id: WorkerId, hashes: Iterable[BlockHash], bits: int, evicted: bool = True) -> None:
        held = self._by_worker.get(worker_id)
        slot = self._slots.get(worker_id)
        if held is None or slot is None:
            return
        blocks, canon = self._blocks, self._canon
        for h in list(hashes):  # `hashes` may be `held` itself
            v = blocks.get(h)
            if v is None:
                continue
            if type(v) is int:
                if v >> _SHIFT != slot:
                    continue
                mask = v & _MASK & ~bits
                if mask:
                    blocks[h] = canon[(slot << _SHIFT) | mask]
                    continue
                del blocks[h]
                last = True
            else:
                assert isinstance(v, dict)
                had = v.get(worker_id)
                if had is None:
                    continue
                mask = had & ~bits
                if mask:
                    v[worker_id] = mask
                    continue
                del v[worker_id]
                if len(v) == 1:
                    ((other, other_mask),) = v.items()
                    blocks[h] = canon[(self._slots[other] << _SHIFT) | other_mask]
                last = False
            held.discard(h)
            self._count_held(worker_id, h, -1)
            self._pending.lost(worker_id, h, evicted)      # it was held, so pending nowhere on the worker
            if last:
                self._count_any(h, -1)
                self._forget_asks(h)
