"""The store's side of the disk tier: what `KVStore` writes to `kvstore.disk.DiskTier` and stages back.

`DiskStaging` keeps, per salted hash on the device or in host memory, the salt root of the
request that cached it (the disk key is `(salt root, hash)`); copies the blocks the host tier
drops (`spill`) or the pool evicts past a full host tier (`offload_dropped`) to the disk tier's
writer; asks the disk tier to read a run back (`read_ahead`) and stages what it read into the
host tier (`poll`), pinned there until the next poll. A block goes to disk with the owner
(tenant) the pool or the host tier had for it, so the disk tier's caps count it (`kvstore.quota`).
Engine thread only, like the store.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.disk import DiskTier
from kvstore.keys import BlockHash
from kvstore.pool import BlockId, BlockPool
from kvstore.quota import Owner
from kvstore.tensors import KVTensors
from kvstore.tiers import HostTier


class DiskStaging:
    """The disk tier below `host`, fed from `host`'s evictions and the pool's (see the module docstring)."""

    def __init__(self, disk: DiskTier, host: HostTier, pool: BlockPool, kv: KVTensors) -> None:
        self.disk, self.host, self.pool, self.kv = disk, host, pool, kv
        self.roots: dict[BlockHash, BlockHash] = {}      # salted hashes on device / host -> salt root
        self._staged: dict[BlockHash, int] = {}          # hash -> times staged from disk, not yet taken
        self._pinned: list[BlockHash] = []               # staged by the last poll, pinned in host
        self.num_staged = 0

    def read_ahead(self, block_hashes: Sequence[BlockHash], salt_root: BlockHash | None) -> bool:
        """See `KVStore.read_ahead`."""
        if not block_hashes:
            return False
        if self._staged.get(block_hashes[0], 0) >= 2:
            return False
        return self.disk.read_ahead([(salt_root, h) for h in block_hashes[:self.host.num_blocks]])

    def poll(self) -> int:
        """Stage the disk tier's finished reads into the host tier (see `KVStore.poll_disk`);
        returns how many were staged."""
        self.host.unpin(self._pinned)
        self._pinned = []
        staged = 0
        for done in self.disk.take_reads():
            if done.blocks is None:
                continue
            room = self.host.num_blocks - self.host.num_pinned_blocks
            keys = [k for k in done.keys[:room]]
            hashes = [h for _, h in keys]
            for root, h in keys:
                if root is not None:
                    self.roots[h] = root
                self._staged[h] = self._staged.get(h, 0) + 1
            staged += self.host.store(hashes, done.blocks[:, :, :len(keys)])
            self.host.pin(hashes)
            self._pinned.extend(hashes)
        if len(self._staged) > 4 * self.host.num_blocks:
            self._staged.clear()
        self.num_staged += staged
        return staged

    def taken(self, block_hashes: Sequence[BlockHash]) -> None:
        """`block_hashes` were onloaded to the device by an admission: no longer staged."""
        for h in block_hashes:
            self._staged.pop(h, None)

    def offload_dropped(self, block_ids: list[BlockId], block_hashes: list[BlockHash], dropped: list[int]) -> None:
        """The pool evicted `block_ids` and the host tier had no room for those at `dropped`:
        queue the ones the disk tier wants straight from the device, and forget their roots."""
        keys = [(self.roots.get(block_hashes[i]), block_hashes[i]) for i in dropped]
        want = [k for k, key in enumerate(keys) if self.disk.wants(key)]
        if want:
            data = self.kv.gather_blocks([int(block_ids[dropped[k]]) for k in want]).movedim(2, 0)
            data = data.to("cpu").contiguous()                              # [n, L, 2, bs, H, D]
            for row, k in enumerate(want):
                self.disk.write_behind(keys[k], data[row], self.pool.owner_of(block_ids[dropped[k]]))
        for i in dropped:
            self.roots.pop(block_hashes[i], None)

    def write_through(self, block_ids: Sequence[BlockId], block_hashes: Sequence[BlockHash],
                      salt_root: BlockHash | None, owner: Owner | None = None) -> None:
        """Blocks the pool just cached for `owner` (`DiskSpec.write_through`): copy the ones the
        disk tier wants and queue them for its writer (a full queue drops them there)."""
        keys = [(salt_root, h) for h in block_hashes]
        want = [i for i, key in enumerate(keys) if self.disk.wants(key)]
        if want:
            data = self.kv.gather_blocks([int(block_ids[i]) for i in want]).movedim(2, 0)
            data = data.to("cpu").contiguous()                              # [n, L, 2, bs, H, D]
            for row, i in enumerate(want):
                self.disk.write_behind(keys[i], data[row], owner)

    def spill(self, block_hashes: list[BlockHash], slots: list[int]) -> None:
        """The host tier's eviction callback: copy the dropped blocks the disk tier wants and
        queue them for its writer (a full queue drops them there)."""
        keys = [(self.roots.get(h), h) for h in block_hashes]
        want = [i for i, key in enumerate(keys) if self.disk.wants(key)]
        if want:
            data = self.host.data[torch.tensor([slots[i] for i in want], dtype=torch.long)]  # [n, L, 2, bs, H, D]
            for row, i in enumerate(want):
                self.disk.write_behind(keys[i], data[row], self.host.quota.owner_of(block_hashes[i]))
        for h in block_hashes:
            if self.pool.get_cached_block(h) is None:
                self.roots.pop(h, None)
