"""`CompactBlockIndex`: the block index with a compact holder table, for large clusters.

Same contract as `router.index.blocks.BlockIndex` (it subclasses it; every query, event and
pending-block rule is the base class's), different storage, made for two costs at 10^6
(block, worker) entries: bytes per entry, and the garbage collector's passes.

- The block → holders map holds ints only. A block held by ONE worker — nearly every block but
  the shared prefixes — maps to `slot << 3 | tier mask`, `slot` the worker's small integer
  number; those ints are canonical (one object per value, kept in `_canon`), so such an entry
  costs the map's slot and the key. A block with two or more holders maps to `_SHARED` and its
  `{worker_id: tier mask}` lives in a side map, `_shared` (the shared prefixes: few); it goes
  back to an int when one holder is left.
- Each worker's blocks are a dict used as an ordered set (`{hash: None}`), not a `set`.

Why: CPython's collector never tracks a dict whose keys and values are all atomic (ints, str,
None) — it is not traversed in any collection — whereas every `set` is tracked, and a dict
holding one dict value is too. With sets and dict values, each full (gen-2) collection
walked every (block, worker) entry twice: at 1,000 workers and 10^6 blocks, passes of
50–350 ms, landing inside routing decisions (`kvmesh bench scale`, the `compact-tracked`
baseline, measures them beside this index). Here the collector sees the small maps only
(`_shared`, `_by_worker`'s 1,000 entries): ~120–140 bytes per entry either way.

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
_SHARED = -1        # the map's value for a block with two or more holders (they are in `_shared`)


class CompactBlockIndex(BlockIndex):
    """`BlockIndex` in containers the garbage collector does not track (module docstring)."""

    def __init__(self, *, fed: bool = True, ask_half_life: float = ASK_HALF_LIFE) -> None:
        super().__init__(fed=fed, ask_half_life=ask_half_life)
        self._blocks: dict[BlockHash, int] = {}  # type: ignore[assignment]
        self._shared: dict[BlockHash, dict[WorkerId, int]] = {}
        self._by_worker: dict[WorkerId, dict[BlockHash, None]] = {}  # type: ignore[assignment]
        self._slots: dict[WorkerId, int] = {}
        self._slot_ids: list[WorkerId | None] = []
        self._free_slots: list[int] = []
        self._canon: list[int] = []       # _canon[v] is v: one object per packed value

    def _new_held(self) -> dict[BlockHash, None]:
        return {}               # {hash: None}: an ordered set the collector does not track

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
        held = self._by_worker.get(worker_id)
        if held is None:
            held = self._by_worker[worker_id] = {}
        slot = self._slot(worker_id)
        base, canon, blocks, shared = slot << _SHIFT, self._canon, self._blocks, self._shared
        asked, by_block, confirm = self._asked, self._pending.by_block, self._pending.confirm
        for h in hashes:
            v = blocks.get(h)
            if v is None:
                blocks[h] = canon[base | bit]
                if h in asked:
                    self._count_any(h, +1)
            elif v >= 0:
                if v >> _SHIFT == slot:
                    blocks[h] = canon[v | bit]
                else:
                    other = self._slot_ids[v >> _SHIFT]
                    assert other is not None, f"block {h:032x} names a free slot"
                    blocks[h] = _SHARED
                    shared[h] = {other: v & _MASK, worker_id: bit}
            else:
                holders = shared[h]
                holders[worker_id] = holders.get(worker_id, 0) | bit
            if h not in held:
                held[h] = None
                if h in asked:
                    self._count_held(worker_id, h, +1)
            if h in by_block:
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
        if v >= 0:
            w = self._slot_ids[v >> _SHIFT]
            assert w is not None, f"block {h:032x} names a free slot"
            return {w: v & _MASK}
        return self._shared[h]

    def _holders(self, h: BlockHash) -> Collection[WorkerId]:
        v = self._blocks.get(h)
        if v is None:
            return ()
        if v >= 0:
            return (self._slot_ids[v >> _SHIFT],)  # type: ignore[return-value]
        return self._shared[h]

    def _entries(self) -> Iterator[tuple[BlockHash, WorkerId, int]]:
        for h, v in self._blocks.items():
            assert type(v) is int, f"block {h:032x} maps to a {type(v).__name__}"
            if v >= 0:
                assert v is self._canon[v], f"block {h:032x}: packed value {v} is not the canonical int"
                w = self._slot_ids[v >> _SHIFT]
                assert w is not None and self._slots.get(w) == v >> _SHIFT, f"block {h:032x} names a free slot"
                yield h, w, v & _MASK
            else:
                assert v == _SHARED, f"block {h:032x} maps to {v}"
                holders = self._shared.get(h, {})
                assert len(holders) >= 2, f"block {h:032x} keeps a holder map of {len(holders)}"
                yield from ((h, w, mask) for w, mask in holders.items())
        assert all(self._blocks.get(h) == _SHARED for h in self._shared), "a side map's block is not marked shared"

    def _drop(self, worker_id: WorkerId, hashes: Iterable[BlockHash], bits: int, evicted: bool = True) -> None:
        held = self._by_worker.get(worker_id)
        slot = self._slots.get(worker_id)
        if held is None or slot is None:
            return
        blocks, canon, shared, asked = self._blocks, self._canon, self._shared, self._asked
        for h in list(hashes):  # `hashes` may be `held` itself
            v = blocks.get(h)
            if v is None:
                continue
            if v >= 0:
                if v >> _SHIFT != slot:
                    continue
                mask = v & _MASK & ~bits
                if mask:
                    blocks[h] = canon[(slot << _SHIFT) | mask]
                    continue
                del blocks[h]
                last = True
            else:
                holders = shared[h]
                had = holders.get(worker_id)
                if had is None:
                    continue
                mask = had & ~bits
                if mask:
                    holders[worker_id] = mask
                    continue
                del holders[worker_id]
                if len(holders) == 1:
                    ((other, other_mask),) = holders.items()
                    blocks[h] = canon[(self._slots[other] << _SHIFT) | other_mask]
                    del shared[h]
                last = False
            del held[h]
            if h in asked:
                self._count_held(worker_id, h, -1)
            self._pending.lost(worker_id, h, evicted)      # it was held, so pending nowhere on the worker
            if last and h in asked:
                self._count_any(h, -1)
                self._forget_asks(h)
