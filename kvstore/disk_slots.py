"""The disk tier's slots: which are free, which are being written or read.

A record lives in one slot of the tier's slab files (`kvstore/disk_record.py`); slot s is in
file s % SLAB_FILES. `SlotTable` hands a writer a free slot from the file the fewest writers are
writing now (buffered writes to one file serialise on its inode lock), and keeps a slot that is
being read from going back to the free lists until its last read ends (the record is evicted
from the index at once; its slot waits). It takes no lock and does no I/O:
`kvstore.disk.DiskTier` calls it under its lock.
"""
from __future__ import annotations

from collections.abc import Iterable


class SlotTable:
    def __init__(self, num_slots: int, files: int, used: Iterable[int] = ()) -> None:
        taken = set(used)
        self.files = files
        # popped from the end: low slots (the start of each file) first
        self._free = [[s for s in range(num_slots - 1, -1, -1) if s % files == k and s not in taken]
                      for k in range(files)]
        self._writing = [0] * files          # records being written into each file now
        self._pins: dict[int, int] = {}      # slot -> reads of it in progress
        self._unfreed: set[int] = set()      # slots freed while pinned: free when the last read ends

    def has_free(self) -> bool:
        return any(self._free)

    def take(self) -> int:
        """A free slot (`has_free`) from the file fewest writers are writing; counted as being
        written until `written`."""
        k = min((k for k in range(self.files) if self._free[k]), key=lambda k: self._writing[k])
        self._writing[k] += 1
        return self._free[k].pop()

    def written(self, slot: int) -> None:
        """`slot`'s write returned (it holds a record now, or is freed by the caller)."""
        self._writing[slot % self.files] -= 1

    def free(self, slot: int) -> None:
        """`slot` holds no record any more: free, once no read holds it."""
        if slot in self._pins:
            self._unfreed.add(slot)
        else:
            self._free[slot % self.files].append(slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins.pop(slot) - 1
        if left:
            self._pins[slot] = left
        elif slot in self._unfreed:
            self._unfreed.discard(slot)
            self._free[slot % self.files].append(slot)

    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    def check_integrity(self, held: list[int], num_slots: int) -> None:
        """`held`: the slots the index maps records to; none is free or held twice."""
        free = [s for f in self._free for s in f]
        assert len(set(held)) == len(held), "two records in one slot"
        assert not set(held) & set(free), "a held slot is free"
        assert len(set(free)) == len(free) and len(free) + len(held) <= num_slots, "slots counted twice"
