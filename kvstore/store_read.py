"""The store's copies for peers: a hash chain's leading run of held blocks, copied out.

`read_held` (behind `KVStore.read`, engine thread) gathers the run from the device pool, the
host tier and the disk tier, in chain order, and copies it to the asking device. `read_device_run`
(behind `KVStore.read_now`, any thread) copies the device pool's run beside a running step and
keeps the blocks whose hash still maps to the block read. Neither references a block.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstore.disk import DiskTier
from kvstore.events import Tier
from kvstore.keys import BlockHash
from kvstore.pool import BlockPool
from kvstore.store_types import HeldBlocks, Match
from kvstore.tensors import KVTensors
from kvstore.tiers import HostTier


def read_held(pool: BlockPool, kv: KVTensors, host: HostTier | None, disk: DiskTier | None,
              block_hashes: Sequence[BlockHash], device: torch.device) -> HeldBlocks:
    """A copy on `device` of the leading run of `block_hashes` held in `pool`, `host` or `disk`
    (host blocks become the tier's youngest; disk records are read in this thread; a bad one
    is dropped, its event left in the disk tier's log). See `KVStore.read`."""
    runs: list[tuple[Tier, list[Any]]] = []     # (tier, block ids | hashes | disk keys)
    key: Any
    for h in block_hashes:
        block_id = pool.get_cached_block(h)
        if block_id is not None:
            tier, key = Tier.DEVICE, int(block_id)
        elif host is not None and h in host:
            tier, key = Tier.HOST, h
        elif disk is not None and (disk_key := disk.key_of(h)) is not None:
            tier, key = Tier.DISK, disk_key
        else:
            break
        if not runs or runs[-1][0] is not tier:
            runs.append((tier, []))
        runs[-1][1].append(key)
    parts, n = [], 0
    for tier, keys in runs:
        if tier is Tier.DEVICE:
            data = kv.gather_blocks(keys)
        elif tier is Tier.HOST:
            assert host is not None
            data = host.read(keys)
        else:
            assert disk is not None
            got, blocks = disk.read_now(keys)
            if blocks is None:
                break
            data = blocks
        parts.append(data.to(device))                        # [L, 2, run, bs, H, D]
        n += data.shape[2]
        if data.shape[2] < len(keys):
            break
    if n == 0:
        return HeldBlocks(0, None)
    return HeldBlocks(n, parts[0] if len(parts) == 1 else torch.cat(parts, dim=2).contiguous())


def read_device_run(pool: BlockPool, kv: KVTensors, disk: DiskTier | None, block_hashes: Sequence[BlockHash],
                    match: Match, device: torch.device) -> HeldBlocks | None:
    """The device run of `match` (`KVStore.lookup(block_hashes)`) copied to `device`, then
    checked: the blocks whose hash still maps to the block read. None where only `read_held`
    on the engine thread can answer (see `KVStore.read_now`)."""
    if kv.device.type != "cpu":
        return None
    rest = block_hashes[len(match.device):]
    if match.num_host or (rest and disk is not None and disk.key_of(rest[0]) is not None):
        return None
    ids = [int(b) for b in match.device]
    if not ids:
        return HeldBlocks(0, None)
    data = kv.gather_blocks(ids)                           # [L, 2, n, bs, H, D]
    n = 0
    for h, block_id in zip(block_hashes, ids):
        if pool.get_cached_block(h) != block_id:
            break
        n += 1
    if n == 0:
        return None
    return HeldBlocks(n, (data if n == len(ids) else data[:, :, :n]).to(device).contiguous())
