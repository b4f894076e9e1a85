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

The tiers below the pool (the host tier, `kvstore.tiers`; the disk tier, `kvstore.disk`) are
plain LRUs of entries (a hash, a disk key), every one evictable; each keeps an `OwnerLRU` of
the same caps over its own size (`max_cached_frac` of that tier, or the same `max_cached_blocks`
count): when it must drop entries, it drops the oldest of owners over their cap first, the
owner furthest over first, until each is back at its cap, then its own oldest.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Container, Hashable, Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

Owner = str
_Ids = OrderedDict[int, None]   # block ids in free-queue order (an ordered set)
K = TypeVar("K", bound=Hashable)


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


class OwnerLRU(Generic[K]):
    """The owners of a tier's entries and each owner's entries oldest first, with caps (the
    module docstring's last paragraph). The tier reports every insert, refresh and removal;
    `victims` says which entries to drop first. Not thread-safe: the tier's (under its lock)."""

    def __init__(self, num_entries: int, max_cached_frac: float = 1.0) -> None:
        if not 0.0 < max_cached_frac <= 1.0:
            raise ValueError(f"max_cached_frac={max_cached_frac!r} must be in (0, 1]")
        self.default_cap = max(1, int(max_cached_frac * num_entries))
        self._owner: dict[K, Owner] = {}
        self._entries: dict[Owner, OrderedDict[K, None]] = {}    # per owner, oldest first
        self._caps: dict[Owner, int] = {}

    def set_cap(self, owner: Owner, max_entries: int | None) -> None:
        """`owner`'s cap in entries (None: back to `default_cap`)."""
        if max_entries is None:
            self._caps.pop(owner, None)
        elif isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"max_cached_blocks={max_entries!r} must be an integer >= 0")
        else:
            self._caps[owner] = max_entries

    def cap(self, owner: Owner) -> int:
        return self._caps.get(owner, self.default_cap)

    def owner_of(self, key: K) -> Owner | None:
        return self._owner.get(key)

    def usage(self) -> dict[Owner, int]:
        """Entries per owner holding any."""
        return {o: len(keys) for o, keys in sorted(self._entries.items())}

    def added(self, key: K, owner: Owner | None) -> None:
        """`key` became the tier's youngest entry, for `owner` (None or "": no owner, uncapped)."""
        self.removed(key)
        if owner:
            self._owner[key] = owner
            self._entries.setdefault(owner, OrderedDict())[key] = None

    def touched(self, key: K) -> None:
        """`key` became the tier's youngest entry (its owner unchanged)."""
        owner = self._owner.get(key)
        if owner is not None:
            self._entries[owner].move_to_end(key)

    def removed(self, key: K) -> None:
        owner = self._owner.pop(key, None)
        if owner is not None:
            entries = self._entries[owner]
            del entries[key]
            if not entries:
                del self._entries[owner]

    def clear(self) -> None:
        self._owner.clear()
        self._entries.clear()

    def victims(self, n: int, keep: Container[K] = (), adding: Sequence[Owner | None] = ()) -> list[K]:
        """Up to `n` entries to drop first, to make room for entries of `adding` (their owners):
        the oldest of owners over their cap counting what they are adding, the owner furthest
        over first, none in `keep` (pinned), until each owner is back at its cap. The tier
        drops its own oldest for the rest. A query."""
        count = Counter({o: len(keys) for o, keys in self._entries.items()})
        count.update(o for o in adding if o)
        over = {o: c - self.cap(o) for o, c in count.items() if c > self.cap(o) and o in self._entries}
        runs = {o: (k for k in self._entries[o] if k not in keep) for o in over}
        chosen: list[K] = []
        while len(chosen) < n and over:
            owner = max(over, key=lambda o: (over[o], o))
            key = next(runs[owner], None)
            if key is None:
                del over[owner]
                continue
            chosen.append(key)
            over[owner] -= 1
            if over[owner] <= 0:
                del over[owner]
        return chosen

    def check_integrity(self, keys: Sequence[K]) -> None:
        """Against the tier's entries `keys`, oldest first."""
        held = set(keys)
        assert set(self._owner) <= held, "an owned entry is not in the tier"
        for owner, entries in self._entries.items():
            assert entries, f"owner {owner!r} keeps an empty entry list"
            assert list(entries) == [k for k in keys if self._owner.get(k) == owner], \
                f"owner {owner!r}: entries out of step with the tier's order"
        assert sum(map(len, self._entries.values())) == len(self._owner), "entry counts disagree"


def _chain(queues: tuple[_Ids, _Ids]) -> Iterator[int]:
    yield from list(queues[0])
    yield from list(queues[1])


def _take(ids: Iterator[int], n: int) -> Iterator[int]:
    for _, block_id in zip(range(n), ids):
        yield block_id
