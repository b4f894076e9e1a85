"""The disk tier's index: which records it holds, in LRU order, and which one to evict next.

`DiskIndex` keeps the keys `(salt root, block hash)` of the records on disk with their slots,
oldest first (a write or a read makes a record the youngest), each hash's salt root (a hash is chained from
its root, so it names one record), and the owners' caps (`kvstore.quota.OwnerLRU`): the next
victim is the oldest record of an owner over its cap, else the oldest record. It touches no
file and takes no lock: `kvstore.disk.DiskTier` calls it under its lock and does the I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvstore.disk_record import DiskKey
from kvstore.keys import BlockHash
from kvstore.quota import Owner, OwnerLRU


class DiskIndex:
    """The records a disk tier holds (see the module docstring); `quota` counts their owners."""

    def __init__(self, quota: OwnerLRU[DiskKey]) -> None:
        self.quota = quota
        self._lru: OrderedDict[DiskKey, int] = OrderedDict()     # -> its slot, oldest first
        self._roots: dict[BlockHash, BlockHash | None] = {}       # block hash -> its record's salt root

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __iter__(self) -> Iterator[DiskKey]:
        """The keys held, oldest first."""
        return iter(self._lru)

    def match_prefix(self, root: BlockHash | None, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading `block_hashes` are held under salt root `root` (a query)."""
        n = 0
        for h in block_hashes:
            if (root, h) not in self._lru:
                break
            n += 1
        return n

    def key_of(self, block_hash: BlockHash) -> DiskKey | None:
        """The key of the record holding `block_hash`, under whichever salt root; None when none is."""
        if block_hash not in self._roots:
            return None
        return self._roots[block_hash], block_hash

    def slot_of(self, key: DiskKey) -> int | None:
        return self._lru.get(key)

    def slots(self) -> list[int]:
        return list(self._lru.values())

    def touch(self, key: DiskKey) -> bool:
        """Make a held record the youngest; False when `key` is not held."""
        if key not in self._lru:
            return False
        self._lru.move_to_end(key)
        self.quota.touched(key)
        return True

    def add(self, key: DiskKey, owner: Owner | None, slot: int) -> None:
        """A record written for `owner` into `slot`: the youngest."""
        self._lru[key] = slot
        self._lru.move_to_end(key)
        self.quota.added(key, owner)
        self._roots[key[1]] = key[0]

    def add_reopened(self, found: Sequence[tuple[DiskKey, int]]) -> None:
        """Records (key, slot) found on disk at open, oldest first, after the ones held (no
        owner: owners are not on disk)."""
        self._lru.update(found)
        self._roots.update((h, root) for (root, h), _ in found)

    def remove(self, key: DiskKey) -> int | None:
        """Forget `key`: its slot; None when it was not held."""
        slot = self._lru.pop(key, None)
        if slot is None:
            return None
        self.quota.removed(key)
        self._roots.pop(key[1], None)
        return slot

    def victim(self, adding: Owner | None = None, *, for_write: bool = False) -> DiskKey:
        """The record to evict next (the index is not empty): the oldest of an owner over its cap,
        counting a record about to be written for `adding` when `for_write`, else the oldest."""
        over = self.quota.victims(1, adding=[adding] if for_write else [])
        return over[0] if over else next(iter(self._lru))

    def clear(self) -> None:
        self._lru.clear()
        self.quota.clear()
        self._roots.clear()

    def check_integrity(self) -> None:
        self.quota.check_integrity(list(self._lru))
