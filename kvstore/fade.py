"""How long the pool's protection of reused blocks lasts unused: a window learned from mistakes.

`kvstore/pool.py` protects a cached block that a later request reused: freed, it is evicted
only after the never-reused (probation) blocks, until it is *stale* — unused while the pool
allocated `window` blocks. Which window is right depends on the traffic. While the same
prefixes come back (a steady workload) a long one keeps them through bursts of one-off
questions; when the traffic moves to new prefixes (a shift: yesterday's system prompts in the
pool, today's arriving) it keeps yesterday's while today's, asked for once so far, are
evicted and computed again.

`Fade` learns the window from the pool's mistakes, as ARC (Megiddo and Modha, FAST 2003)
learns its recency/frequency split from ghost lists:

- it remembers the hashes of the last `num_blocks` cached blocks evicted from probation, and
  of the last `num_blocks` evicted from the protected queue (stale): hashes only, no content
  (at most 2 x `num_blocks` dict entries of a 128-bit hash, ~150 bytes each: 30 MB for a
  100,000-block pool);
- a remembered hash cached again (`recached`: computed, fetched or read back again, so it was
  needed) is a mistake of its side. A probation ghost says protection kept the wrong blocks:
  the window shrinks by `num_blocks / steps` allocations; a protected ghost says it let a
  needed block go too soon: the window grows as much. The window stays within
  [`MIN_TURNOVERS`, `MAX_TURNOVERS`] x `num_blocks`;
- a ghost cached again counts as reused (ARC moves a ghost hit to its frequency list): the
  block was asked for twice, so freed it joins the protected queue.

ARC scales each step by the ratio of the two ghost lists' lengths; here the probation list is
mostly finished requests' own tails, which no request asks for again, so that ratio would
measure the tails, not the mistakes: the steps are equal. With no mistakes the window stays
where it started (`protect_turnovers`). `steps` (`FADE_STEPS`) is measured with
`kvmesh.bench.routing_sweeps.sweep_fade` (docs/routing.md has the figures).
"""
from __future__ import annotations

from collections import OrderedDict

from kvstore.keys import BlockHash

FADE_STEPS = 128.0     # mistakes that move the window by one pool size (None at BlockPool: fixed)
MIN_TURNOVERS = 0.125
MAX_TURNOVERS = 4.0


class Fade:
    """The stale window of a pool of `num_blocks` blocks, in allocations, starting at
    `turnovers` x num_blocks; `steps` None: fixed there (no ghosts are kept)."""

    __slots__ = ("window", "_steps", "_capacity", "_step", "_lo", "_hi", "_probation", "_protected",
                 "shrinks", "grows")

    def __init__(self, num_blocks: int, turnovers: float, steps: float | None = FADE_STEPS) -> None:
        if steps is not None and not steps > 0:
            raise ValueError(f"fade_steps={steps!r} must be > 0 (None: a fixed window)")
        self.window = turnovers * num_blocks   # a float: a step may be under one allocation
        self._steps = steps
        self._capacity = num_blocks
        self._step = num_blocks / steps if steps is not None else 0.0
        self._lo = min(self.window, MIN_TURNOVERS * num_blocks)
        self._hi = max(self.window, MAX_TURNOVERS * num_blocks)
        self._probation: OrderedDict[BlockHash, None] = OrderedDict()
        self._protected: OrderedDict[BlockHash, None] = OrderedDict()
        self.shrinks = self.grows = 0      # the mistakes seen of each side

    def evicted(self, block_hash: BlockHash, protected: bool) -> None:
        """`allocate` dropped `block_hash`; `protected`: the block was in the protected queue."""
        if self._steps is None:
            return
        ghosts = self._protected if protected else self._probation
        ghosts[block_hash] = None
        ghosts.move_to_end(block_hash)
        if len(ghosts) > self._capacity:
            ghosts.popitem(last=False)

    def recached(self, block_hash: BlockHash) -> bool:
        """`block_hash` is cached again. True: it was a ghost (needed after its eviction: a
        reuse), and the window moved."""
        if self._steps is None:
            return False
        if self._probation.pop(block_hash, 0) is None:
            self.window = max(self._lo, self.window - self._step)
            self.shrinks += 1
            return True
        if self._protected.pop(block_hash, 0) is None:
            self.window = min(self._hi, self.window + self._step)
            self.grows += 1
            return True
        return False

    def clear(self) -> None:
        """Forget the ghosts (the pool dropped every cached hash); the window stays."""
        self._probation.clear()
        self._protected.clear()
