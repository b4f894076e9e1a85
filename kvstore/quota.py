"""Per-owner caps on the cached blocks of a block pool (KV quotas per tenant).

Every cached block of `kvstore.pool.BlockPool` may carry an *owner* (the tenant whose request
cached it; None: no owner, never capped). An owner may cache more than its cap while the pool
has room; the cap decides what an allocation evicts when some owner is over it:

1. free blocks that cache nothing (they cost nobody a hit),
2. free cached blocks of owners over their cap, the owner furthest over first, each owner's in
   its own free order (never-reused blocks before reused ones, least recently freed first),
   until that owner is back at its cap,
3. then the pool's plain order (segmented LRU, `kvstore.pool`).

So a tenant flooding the pool with distinct prompts evicts its own cached blocks first while it
is over its cap and has free ones; another tenant's cache is evicted only when nobody over a
cap has a free cached block left. With no owner over its cap the pool's order is unchanged.

Caps: `set_cap(owner, n)` (the keys file's `max_cached_blocks`, sent with each request), else
`default_cap` = `max_cached_frac` of the pool (1.0: no cap). `CachedQuota` holds only ids and
counts; the pool calls it at every change of a block's state (freed, taken off the free queue,
cached, uncached, moved between its free queues). Imports no torch.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

Owner = str
_Ids = OrderedDict[int, None]   # block ids in free-queue order (an ordered set)


class OwnerUsage(NamedTuple):
    """One owner's cached blocks (in use or free), how many of them are free, and its cap."""

    num_cached_blocks: int
    num_free_cached_blocks: int
    cap: int


class CachedQuota:
    """The owner of every cached block, cached blocks per owner, and each owner's free cached
    blocks in free-queue order (see the module docstring). Not thread-safe: the pool's."""

    def __init__(self, num_blocks: int, max_cached_frac: float = 1.0) -> None:
        if not 0.0 < max_cached_frac <= 1.0:
            raise ValueError(f"max_cached_frac={max_cached_frac!r} must be in (0, 1]")
        self.num_blocks = num_blocks
        self.default_cap = max(1, int(max_cached_frac * num_blocks))
        self._owner: list[Owner | None] = [None] * num_blocks
        self._count: Counter[Owner] = Counter()
        self._free: dict[Owner, tuple[_Ids, _Ids]] = {}          # owner -> (probation, protected)
        self._empty: _Ids = OrderedDict((i, None) for i in range(num_blocks))  # free, caching nothing
        self._caps: dict[Owner, int] = {}

    # -- caps and queries -------------------------------------------------------------------
    def set_cap(self, owner: Owner, max_blocks: int | None) -> None:
        """`owner`'s cap in blocks (None: back to `default_cap`)."""
        if max_blocks is None:
            self._caps.pop(owner, None)
        elif isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0:
            raise ValueError(f"max_cached_blocks={max_blocks!r} must be an integer >= 0")
        else:
            self._caps[owner] = max_blocks

    def cap(self, owner: Owner) -> int:
        return self._caps.get(owner, self.default_cap)

    def owner_of(self, block_id: int) -> Owner | None:
        return self._owner[block_id]

    def usage(self) -> dict[Owner, OwnerUsage]:
        """Every owner holding cached blocks now."""
        return {o: OwnerUsage(n, sum(map(len, self._free.get(o, ((), ())))), self.cap(o))
                for o, n in sorted(self._count.items()) if n}

    def over_cap(self) -> dict[Owner, int]:
        """Owners over their cap that have free cached blocks: how many blocks over."""
        return {o: n - self.cap(o) for o, n in self._count.items()
                if n > self.cap(o) and any(self._free.get(o, ((), ())))}

    # -- what the pool reports ----------------------------------------------------------------
    def cached(self, block_id: int, owner: Owner | None) -> None:
        """A held block now caches a hash for `owner`."""
        assert self._owner[block_id] is None, f"block {block_id} already has an owner"
        if owner:
            self._owner[block_id] = owner
            self._count[owner] += 1

    def uncached(self, block_id: int) -> None:
        """A block's hash was dropped (evicted or reset); it is not in a free set."""
        owner = self._owner[block_id]
        if owner is not None:
            self._owner[block_id] = None
            self._count[owner] -= 1
            if not self._count[owner]:
                del self._count[owner]

    def freed(self, block_id: int, has_hash: bool, protected: bool) -> None:
        """A block joined the tail of a free queue (the protected one if `protected`)."""
        owner = self._owner[block_id]
        if not has_hash:
            self._empty[block_id] = None
        elif owner is not None:
            self._free.setdefault(owner, (OrderedDict(), OrderedDict()))[protected][block_id] = None

    def unfreed(self, block_id: int) -> None:
        """A block left the free queues (allocated, or touched by a request reusing it)."""
        if block_id in self._empty:
            del self._empty[block_id]
            return
        owner = self._owner[block_id]
        if owner is not None:
            probation, protected = self._free[owner]
            del (probation if block_id in probation else protected)[block_id]
            if not probation and not protected:
                del self._free[owner]

    def demoted(self, block_id: int) -> None:
        """A free block moved from the protected queue's head to the probation queue's tail."""
        owner = self._owner[block_id]
        if owner is not None:
            probation, protected = self._free[owner]
            del protected[block_id]
            probation[block_id] = None

    def reset(self, free_ids: Sequence[int]) -> None:
        """Every hash was dropped: no owners; the free blocks, in queue order, cache nothing."""
        self._owner = [None] * self.num_blocks
        self._count.clear()
        self._free.clear()
        self._empty = OrderedDict((int(b), None) for b in free_ids)

    # -- eviction order -----------------------------------------------------------------------
    def victims(self, n: int) -> list[int] | None:
        """The first of `n` blocks an allocation takes under the caps (steps 1 and 2 of the
        module docstring; the pool fills the rest in its own order), or None when no owner is
        over its cap (the pool's order alone). A query."""
        over = self.over_cap()
        if not over:
            return None
        chosen = list(_take(iter(self._empty), n))
        runs = {o: _chain(self._free[o]) for o in over}
        while len(chosen) < n and over:
            owner = max(over, key=lambda o: (over[o], o))
            block_id = next(runs[owner], None)
            if block_id is None:
                del over[owner]
                continue
            chosen.append(block_id)
            over[owner] -= 1
            if over[owner] <= 0:
                del over[owner]
        return chosen

    def check_integrity(self, hashed: Sequence[bool], free_order: Sequence[tuple[int, bool]]) -> None:
        """Against the pool: `hashed[b]` whether block b caches a hash; `free_order` the free
        blocks (id, in the protected queue) probation first, each queue head first."""
        counts = Counter(o for o in self._owner if o is not None)
        assert counts == +self._count, f"cached blocks per owner {dict(self._count)} != recount {dict(counts)}"
        assert all(hashed[b] for b, o in enumerate(self._owner) if o is not None), "an uncached block has an owner"
        empty = [b for b, _ in free_order if not hashed[b]]
        assert list(self._empty) == empty, "the free blocks caching nothing disagree with the free queue"
        for owner in set(self._free) | set(counts):
            probation, protected = self._free.get(owner, (OrderedDict(), OrderedDict()))
            for flag, ids in ((False, probation), (True, protected)):
                want = [b for b, p in free_order if p == flag and hashed[b] and self._owner[b] == owner]
                assert list(ids) == want, f"owner {owner!r}: free cached blocks out of step with the free queue"
        assert all(any(v) for v in self._free.values()), "an owner keeps an empty free set"


def _chain(queues: tuple[_Ids, _Ids]) -> Iterator[int]:
    yield from list(queues[0])
    yield from list(queues[1])


def _take(ids: Iterator[int], n: int) -> Iterator[int]:
    for _, block_id in zip(range(n), ids):
        yield block_id
