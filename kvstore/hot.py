"""Which blocks a store is hit for: recent prefix hits per block hash, decayed by age.

`HitTracker.hit(chain)` counts one hit on each hash of a prompt's leading run that admission
found cached (the store calls it from `take`). A hit at time t weighs 2^(t / half_life_s), so
a score is a sum of weights and ranking by score ranks by hits decayed with that half-life;
the weights are rebased (every score divided by the same power of two) before they grow past
2^40. `hottest` lists hashes by score, highest first, and for equal scores the shallower one
(nearer the prompt's start) first: a parent is hit whenever its child is, so the list keeps
each chain's parents ahead of its children and a prefix of it is a usable set of prefixes.

Bounded: past `max_entries` hashes the lower-scoring half is forgotten. No torch, no I/O;
not thread-safe (the store's engine thread owns it).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvstore.keys import BlockHash

_REBASE_EXPONENT = 40.0


class HitTracker:
    """Decayed hit counts per block hash (see the module docstring)."""

    def __init__(self, half_life_s: float = 300.0, max_entries: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s={half_life_s!r} must be > 0")
        if max_entries < 2:
            raise ValueError(f"max_entries={max_entries!r} must be >= 2")
        self.half_life_s = half_life_s
        self.max_entries = max_entries
        self._clock = clock
        self._base = clock()
        self._score: dict[BlockHash, float] = {}
        self._depth: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._score)

    def hit(self, chain: Sequence[BlockHash]) -> None:
        """One hit on each of `chain`, a prompt's leading blocks in order (position 0 first)."""
        if not chain:
            return
        exponent = (self._clock() - self._base) / self.half_life_s
        if exponent > _REBASE_EXPONENT:
            self._rebase(exponent)
            exponent = 0.0
        w = 2.0 ** exponent
        score, depth = self._score, self._depth
        for i, h in enumerate(chain):
            score[h] = score.get(h, 0.0) + w
            if depth.get(h, i) >= i:
                depth[h] = i
        if len(score) > self.max_entries:
            self._forget_coldest(len(score) - self.max_entries // 2)

    def score(self, block_hash: BlockHash) -> float:
        """Hits on `block_hash` decayed to now (0.0: never hit, or forgotten)."""
        now = (self._clock() - self._base) / self.half_life_s
        return self._score.get(block_hash, 0.0) / 2.0 ** now

    def hottest(self, held: Callable[[BlockHash], bool], max_blocks: int) -> list[BlockHash]:
        """Up to `max_blocks` hashes for which `held(h)` is true, hottest first (parents
        before children for equal scores). A query: nothing is forgotten."""
        if max_blocks <= 0:
            return []
        order = sorted(self._score, key=lambda h: (-self._score[h], self._depth[h]))
        out: list[BlockHash] = []
        for h in order:
            if held(h):
                out.append(h)
                if len(out) == max_blocks:
                    break
        return out

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        for h in block_hashes:
            self._score.pop(h, None)
            self._depth.pop(h, None)

    def _rebase(self, exponent: float) -> None:
        scale = 2.0 ** -exponent
        for h in self._score:
            self._score[h] *= scale
        self._base += exponent * self.half_life_s

    def _forget_coldest(self, n: int) -> None:
        coldest = sorted(self._score, key=self._score.__getitem__)[:n]
        self.forget(coldest)
