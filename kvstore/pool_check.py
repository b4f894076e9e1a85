"""`kvstore.pool.BlockPool.check_integrity`: every invariant of the pool's blocks, free queues,
hash map and owner quota, checked from the outside of its state (a failure is a bug)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstore.free_queue import Block, BlockId, FreeQueue
from kvstore.keys import BlockHash
from kvstore.quota import CachedQuota


def check_pool_args(num_blocks: int, protected_frac: float, protect_turnovers: float | None) -> None:
    """ValueError naming the first `BlockPool` argument out of range."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer")
    if not 0.0 <= protected_frac <= 1.0:
        raise ValueError(f"protected_frac={protected_frac!r} must be in [0, 1]")
    if protect_turnovers is not None and not protect_turnovers > 0:
        raise ValueError(f"protect_turnovers={protect_turnovers!r} must be > 0 (None: never fades)")


def check_pool_integrity(blocks: Sequence[Block], free: FreeQueue, protected: FreeQueue, max_protected: int,
                         num_reused: int, index: Mapping[BlockHash, BlockId], quota: CachedQuota) -> None:
    """Raise AssertionError describing the first broken invariant, if any (`free`: the probation
    queue, `protected`: the protected one, `index`: the hash map)."""
    n = len(blocks)
    forward: list[Block] = []
    for name, queue in (("probation free", free), ("protected free", protected)):
        walk = queue.walk(forward=True, limit=n + 1)  # n + 1: a cycle shows
        backward = queue.walk(forward=False, limit=n + 1)
        assert len(walk) <= n, f"{name} queue has a cycle (forward walk)"
        assert len(walk) == len(queue), f"{name} queue length {len(queue)} != {len(walk)} linked blocks"
        assert walk == backward[::-1], f"{name} queue forward and backward walks disagree"
        assert all(b.protected == (queue is protected) for b in walk), \
            f"a block's protected flag disagrees with its place in the {name} queue"
        forward += walk
    assert len(protected) <= max_protected, "protected queue over its cap"
    assert all(b.reused and b.block_hash is not None for b in protected.walk(True, n)), \
        "the protected queue holds a block that caches nothing or was never reused"
    assert all(b.block_hash is not None or not b.reused for b in blocks), \
        "an uncached block is marked reused"
    assert num_reused == sum(b.reused for b in blocks), "reused-block count is off"
    free_ids = {b.block_id for b in forward}
    assert len(free_ids) == len(forward), "a block appears twice in the free queue"
    for block in blocks:
        is_free = block.block_id in free_ids
        assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
        assert (block.ref_cnt == 0) == is_free, f"block {block.block_id} has ref_cnt " \
            f"{block.ref_cnt} but is {'' if is_free else 'not '}in the free queue"
        assert is_free or block.prev is None and block.next is None, \
            f"used block {block.block_id} still has free-queue links"
    used = sum(b.ref_cnt > 0 for b in blocks)
    assert len(forward) + used == n, f"{len(forward)} free + {used} used != {n} blocks"
    for block_hash, block_id in index.items():
        assert blocks[block_id].block_hash == block_hash, \
            f"hash map sends {block_hash:032x} to block {block_id}, which caches another"
    cached = sum(b.block_hash is not None for b in blocks)
    assert cached == len(index), \
        f"{cached} blocks carry a hash but the hash map has {len(index)}"
    quota.check_integrity([b.block_hash is not None for b in blocks],
                                [(b.block_id, b.protected) for b in forward])
