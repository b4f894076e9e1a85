"""Admissions that wait for room (`SchedulerConfig.room_wait_steps`, `--room-wait-steps`).

A waiting request is put off a step when the blocks it takes (with a whole prompt scheduled,
those its output will fill too) would evict a shared prefix (protected, not stale:
`kvstore.pool.BlockPool.protected_victims`) while the running requests hold at least as many
blocks of their own, which finishing frees first: a full pool then runs one request fewer for a
few steps instead of recomputing an evicted prefix later (and a router that sent a prefix's
requests here keeps finding it). Never with nothing running, so a request that only eviction can
make room for is not held back; never past `room_wait_steps` steps. Measured: docs/routing.md,
"Room for the running requests".
"""
from __future__ import annotations

from collections.abc import Sequence

from kvstore.pool import BlockPool
from kvstore.store_types import Match
from worker.engine.request import Request


def waits_for_room(req: Request, running: Sequence[Request], pool: BlockPool, match: Match, num_blocks: int,
                   block_size: int, max_steps: int) -> bool:
    """Whether `req` (its lookup `match`, `num_blocks` blocks in all) waits this step."""
    if not max_steps or not running or req.num_room_waits >= max_steps:
        return False
    shared = pool.protected_victims(num_blocks - len(match.device), keep=match.device)
    return 0 < shared <= own_blocks(running, block_size)


def own_blocks(running: Sequence[Request], block_size: int) -> int:
    """Blocks the running requests hold that no shared prefix does: past the prompt's cached
    blocks and the router's shared-prefix hint (freed, they go to the probation queue)."""
    return sum(max(0, len(r.held_block_ids) - max(r.num_cached_tokens // block_size, r.shared_prefix_blocks))
               for r in running)
