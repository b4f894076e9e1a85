"""Where blocks live: block hash → the workers holding it, and in which tiers.

Fed by the workers' KV event streams (`kvstore.metadata.streams.EventConsumer` calls `apply`,
`clear_worker`, `remove_worker`); read by the routing policy through `match_prefix`. In
memory only and torch-free. Not thread-safe: one event loop owns it (the consumer and the
policy run on the router's loop).

A worker may hold one block in several tiers at once (a device copy being offloaded to
host memory), so each (block, worker) entry is a set of tiers, kept as a bit mask; the
entry goes when its last tier goes. Removing a worker is O(its blocks): a per-worker set
of hashes mirrors the main map.

Pending blocks (router/index/pending.py): when the router sends a request to a worker it
records the prompt's blocks as *pending* there (`add_pending`), a prediction that the worker is
computing them. `match_prefix` counts a pending block like a stored one, so the requests that
follow are drawn to the worker already computing their prefix. A pending entry goes when the
worker's `BlockStored` event for it arrives (confirmed), when the request fails before its
prefill (`drop_pending`), or at its expiry (`add_pending`'s `expires_at`, shortened by
`settle_pending` once the request is done: the events should arrive within the grace). A
block a running request asks for that goes from its worker becomes pending for the request
(unless a correction dropped it: `forget`).

Shared blocks: `add_pending` also counts, per block, the requests whose prompts held it (up to
two); `shared_blocks(worker)` is the part of a worker's pool a new placement would displace:
its blocks asked for twice, plus those asked once at their depth's measured reuse rate (the
tallies: router/index/asks.py), forgotten once no worker holds or computes the block.

Evidence fades with the traffic since a block's last ask (router/index/asks.py), so a prefix
no one asks for any more counts as room, whatever it was worth once.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore.events import EventType, Tier, WireEvent, WorkerId
from kvstore.keys import BlockHash
from router.index.asks import ASK_HALF_LIFE, DEPTHS, Ask, Decay, Reuse, Tally, TallyTable, recount, shared_prefix
from router.index.check import ALL_TIERS, check_holders
from router.index.lookup import disk_only_counts, leading_counts, leading_pair
from router.index.pending import PendingBlocks

_BIT = {tier: 1 << i for i, tier in enumerate(Tier)}  # Tier order: fastest first
_KINDS = tuple(range(2 * DEPTHS))    # one int object per (depth, num_asks) an ask map holds


class IndexStats(NamedTuple):
    """`num_blocks`: distinct hashes held anywhere; `num_entries`: (hash, worker) pairs."""

    num_blocks: int
    num_entries: int
    num_workers: int
    events_applied: int
    num_pending: int = 0      # (hash, worker) pairs predicted and not yet confirmed


def _tiers(mask: int) -> frozenset[Tier]:
    return frozenset(tier for tier, bit in _BIT.items() if mask & bit)


class BlockIndex:
    """block hash → {worker_id: tiers}; see the module docstring."""

    def __init__(self, *, fed: bool = True, ask_half_life: float = ASK_HALF_LIFE) -> None:
        """`fed=False`: no event stream feeds this index (a router without a metadata Redis): it
        stays empty and `add_pending` records nothing, since no `BlockStored` would confirm it.
        `ask_half_life`: pool-fulls of routed prompt blocks over which a block's evidence of
        being shared halves (router/index/asks.py)."""
        self.fed = fed
        self._blocks: dict[BlockHash, dict[WorkerId, int]] = {}
        self._by_worker: dict[WorkerId, set[BlockHash]] = {}
        self._generations: dict[WorkerId, int] = {}   # the highest generation (epoch) seen per worker
        self.num_stale_events = 0
        self._applied = 0
        self._pending = PendingBlocks()
        # each asked block's `Ask`, in two maps of atomic values the garbage collector never
        # tracks (a map of Ask tuples would be traversed whole by every full collection):
        self._asked: dict[BlockHash, int] = {}         # _KINDS[depth << 1 | (num_asks − 1)]
        self._asked_at: dict[BlockHash, float] = {}    # Ask.at
        self._held_asks = TallyTable()               # each worker's blocks by their asks (a row each)
        self._rows_of: tuple[tuple[WorkerId, ...], int, np.ndarray] | None = None   # shared_blocks_of's last rows
        self._any_asks = Tally()                     # the same over the distinct blocks held anywhere
        self._reuse = Reuse()                        # per depth: blocks first asked, asked again, settled
        self._decay = Decay(ask_half_life)
        self._capacity = 0                           # the pools' blocks; 0: the traffic clock stands

    def apply(self, worker_id: WorkerId, event: WireEvent, generation: int | None = None) -> None:
        """Apply one wire event of `worker_id` (its meaning: `kvstore.events`); the worker
        becomes known if it was not. Fenced by `generation` (the worker's epoch; None: not
        checked): an event of a generation below the highest seen for the worker is dropped
        (counted in `num_stale_events`), and a higher one first forgets the worker's blocks."""
        if generation is not None:
            known = self._generations.get(worker_id)
            if known is not None and generation < known:
                self.num_stale_events += 1
                return
            if known is not None and generation > known:
                self.clear_worker(worker_id)
            self._generations[worker_id] = generation
        if worker_id not in self._by_worker:
            self._by_worker[worker_id] = self._new_held()
        kind = event.type
        if kind is EventType.STORED:
            self.add(worker_id, event.hashes, event.tier)
        elif kind is EventType.REMOVED:
            self.discard(worker_id, event.hashes, event.tier)
        elif kind is EventType.CLEARED:
            self._drop(worker_id, self._by_worker.get(worker_id, ()), _BIT[event.tier])
        elif kind is EventType.INVENTORY_BEGIN:
            self.clear_worker(worker_id)
        else:
            assert kind is EventType.INVENTORY_END, f"unknown event type {kind!r}"
        self._applied += 1

    def add(self, worker_id: WorkerId, hashes: Iterable[BlockHash], tier: Tier) -> None:
        """`worker_id` now holds `hashes` in `tier` (idempotent)."""
        bit = _BIT[tier]
        held = self._by_worker.setdefault(worker_id, set())
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                holders = self._blocks[h] = {}
                self._count_any(h, +1)
            holders[worker_id] = holders.get(worker_id, 0) | bit
            if h not in held:
                held.add(h)
                self._count_held(worker_id, h, +1)
            self._pending.confirm(worker_id, h)    # the prediction is now a stored block

    def discard(self, worker_id: WorkerId, hashes: Iterable[BlockHash], tier: Tier) -> None:
        """`worker_id` no longer holds `hashes` in `tier` (unknown ones are ignored)."""
        self._drop(worker_id, hashes, _BIT[tier])

    def forget(self, worker_id: WorkerId, hashes: Iterable[BlockHash]) -> None:
        """`worker_id` evidently no longer holds `hashes` in any tier (it served less than they
        promised, router/routing/predictions.py): drop those entries; its events or an
        inventory bring back what it does hold. The requests running there no longer ask for
        them (their worker's events are in doubt: the inventory, not a prediction, tells)."""
        self._drop(worker_id, hashes, ALL_TIERS, evicted=False)

    def clear_worker(self, worker_id: WorkerId) -> None:
        """Forget every block of `worker_id`; it stays known (with no blocks)."""
        self._drop(worker_id, self._by_worker.get(worker_id, ()), ALL_TIERS)
        self._by_worker[worker_id] = self._new_held()

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget `worker_id` altogether (it left routing), with its pending blocks."""
        self._drop(worker_id, self._by_worker.get(worker_id, ()), ALL_TIERS)
        self._by_worker.pop(worker_id, None)
        self._held_asks.pop(worker_id)
        for rid in self._pending.on_worker(worker_id):
            self.drop_pending(rid)

    # -- pending (in-flight) blocks --------------------------------------------------------
    def add_pending(self, request_id: str, worker_id: WorkerId, hashes: Iterable[BlockHash],
                    expires_at: float, resubmitted: bool = False) -> None:
        """`request_id` was sent to `worker_id`, which will compute and store `hashes`; the
        blocks it already holds, or another request computes there, are not recorded (the
        request waits on those: `computing`). Replaces an earlier record of the request, and
        counts the request's asks for `hashes` (shared blocks) once: not again while a record of
        it is kept; when `resubmitted` (a retry or migration whose first attempt counted them)
        only for the blocks whose ask counts were forgotten since (held and computed nowhere).
        Records nothing in an index that is not `fed`."""
        if not self.fed:
            return
        retry = request_id in self._pending
        self.drop_pending(request_id)
        hashes = tuple(hashes)
        if not retry:
            self._count_asks(hashes, resubmitted)
        held = self._by_worker.get(worker_id)
        if held is None:
            held = self._by_worker[worker_id] = self._new_held()
        self._pending.record(request_id, worker_id, hashes, held, expires_at)

    def settle_pending(self, request_id: str, expires_at: float) -> None:
        """The request's prefill is done (its blocks are stored on the worker): keep its
        unconfirmed blocks pending until `expires_at` at the latest, for the events to arrive;
        it asks for no more blocks (one that goes from the worker now was not its to store)."""
        self._pending.settle(request_id, expires_at)

    def drop_pending(self, request_id: str) -> None:
        """Forget what `request_id` predicted (it failed or was aborted before its prefill)."""
        for h in self._pending.drop(request_id):
            self._forget_asks(h)

    def expire_pending(self, now: float) -> int:
        """Drop every prediction whose expiry is at or before `now`; returns how many."""
        expired = self._pending.expired(now)
        for rid in expired:
            self.drop_pending(rid)
        return len(expired)

    def computing(self, worker_id: WorkerId, block_hashes: Sequence[BlockHash]) -> set[str]:
        """The requests whose pending blocks on `worker_id` cover any of `block_hashes` that
        it does not hold yet (those a request for this prefix would wait on there)."""
        return self._pending.computing(worker_id, block_hashes)

    def shared_blocks(self, worker_id: WorkerId) -> float:
        """The shared blocks `worker_id` holds (any tier), expected: those two requests'
        prompts held, plus those one did at the rate blocks of their depth were asked again."""
        return float(self.shared_blocks_of([worker_id])[0])

    def shared_blocks_of(self, worker_ids: Sequence[WorkerId]) -> np.ndarray:
        """`shared_blocks` of each of `worker_ids` (the same floats), in one vectorized pass."""
        table, key = self._held_asks, tuple(worker_ids)
        cached = self._rows_of
        if cached is None or cached[0] != key or cached[1] != table.version:
            cached = self._rows_of = (key, table.version, table.rows(key))
        return table.expected(cached[2], self._reuse.first, self._reuse.again, self._decay.scale())

    def set_capacity(self, num_blocks: int) -> None:
        """The pools' size, in blocks, that the traffic clock measures routed prompts against
        (the router passes its live workers' total; 0 stops the clock)."""
        self._capacity = max(0, num_blocks)

    @property
    def traffic_clock(self) -> float:
        """Pool-fulls of prompt blocks routed so far (asks counted while a capacity was set)."""
        return self._decay.now

    def _count_asks(self, hashes: Sequence[BlockHash], resubmitted: bool) -> None:
        """One more request asked for `hashes` (its asks renew their evidence and the traffic
        clock moves on); a `resubmitted` one counts only where no count is kept."""
        if not resubmitted and self._capacity > 0:
            self._decay.now += len(hashes) / self._capacity
            if self._decay.needs_rebase():
                self._rebase()
            self._reuse.advance(self._decay.now)
        now = self._decay.now
        for depth, h in enumerate(hashes):
            seen = self._ask(h)
            if seen is not None and resubmitted:
                continue
            holders = self._holders(h)
            if holders:
                self._count_any(h, -1)
            ask = Ask(1, min(depth, DEPTHS - 1), now) if seen is None else Ask(2, seen.depth, now)
            if seen is None:
                self._reuse.asked_first(h, ask.depth, now)
            elif seen.num_asks < 2:
                self._reuse.asked_again(h, seen, now)
            self._asked[h] = _KINDS[ask.depth << 1 | (ask.num_asks - 1)]
            self._asked_at[h] = now
            if holders:     # every holder's tally: the old asks out, the new in
                self._held_asks.move(holders, seen, 0.0 if seen is None else self._decay.weight(seen), ask,
                                     self._decay.weight(ask))
                self._count_any(h, +1)

    def shared_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """`asks.shared_prefix` of the asks counted so far (call it before `add_pending`)."""
        return shared_prefix(self._asked, self._reuse.settled, self._reuse.again, block_hashes)

    def distinct_shared_blocks(self) -> float:
        """`shared_blocks` over the distinct blocks held anywhere: the pool space the cluster's
        shared prefixes take with one copy each."""
        return self._any_asks.expected(self._reuse.first, self._reuse.again, self._decay.scale())

    def distinct_held_blocks(self) -> float:
        """Distinct blocks held anywhere that a prompt asked for, in full at their fading weight."""
        return self._any_asks.held(self._decay.scale())

    def _ask(self, h: BlockHash) -> Ask | None:
        """`h`'s asks (None: no request asked for it, or its count was forgotten)."""
        kind = self._asked.get(h)
        return None if kind is None else Ask((kind & 1) + 1, kind >> 1, self._asked_at[h])

    def _count_any(self, h: BlockHash, sign: int) -> None:
        seen = self._ask(h)
        if seen is not None:
            self._any_asks.count(seen, self._decay.weight(seen), sign)

    def _count_held(self, worker_id: WorkerId, h: BlockHash, sign: int) -> None:
        seen = self._ask(h)
        if seen is not None:
            self._held_asks.count(worker_id, seen, self._decay.weight(seen), sign)

    def _recount(self) -> tuple[dict[WorkerId, Tally], Tally]:
        """The tallies counted afresh from the blocks held and their asks."""
        at = self._asked_at
        asked = {h: Ask((kind & 1) + 1, kind >> 1, at[h]) for h, kind in self._asked.items()}
        return recount(self._by_worker, self._blocks, asked, self._decay)

    def _rebase(self) -> None:
        """Move the weights' base to now (they would soon outgrow floating point)."""
        self._decay.base = self._decay.now
        held, self._any_asks = self._recount()
        self._held_asks.load(held)

    def _forget_asks(self, h: BlockHash) -> None:
        if h not in self._blocks and h not in self._pending.by_block:
            if self._asked.pop(h, None) is not None:
                del self._asked_at[h]

    def pending_requests(self) -> list[str]:
        return self._pending.requests()

    def match_prefix(self, block_hashes: Sequence[BlockHash],
                     workers: Iterable[WorkerId] | None = None, *, pending: bool = True) -> dict[WorkerId, int]:
        """For each of `workers` (default: every known worker), how many LEADING blocks of
        `block_hashes` it holds in any tier — or computes (pending), unless `pending=False`:
        the count stops at its first missing block."""
        leading = self.match_leading(block_hashes, pending=pending)
        return {w: leading.get(w, 0) for w in (self._by_worker if workers is None else workers)}

    def match_leading(self, block_hashes: Sequence[BlockHash], *, pending: bool = True) -> dict[WorkerId, int]:
        """`match_prefix` over every worker, sparse: only the workers holding (or computing,
        unless `pending=False`) at least the first block, with their counts — O(the prompt's
        blocks × their holders), whatever the number of workers (router/index/lookup.py)."""
        return leading_counts(block_hashes, self._holders, self._pending.by_block if pending else {})

    def match_leading_pair(self, block_hashes: Sequence[BlockHash]) -> tuple[dict[WorkerId, int], dict[WorkerId, int]]:
        """`match_leading` with pending blocks and without, for about the cost of one (lookup.py)."""
        return leading_pair(block_hashes, self._holders, self._pending.by_block)

    def disk_only(self, block_hashes: Sequence[BlockHash], counts: Mapping[WorkerId, int]) -> dict[WorkerId, int]:
        """Of each worker's `counts[w]` leading `block_hashes` (`match_leading`'s counts), how many
        it holds in its disk tier only (no device or host copy): blocks it must read back before
        they count. Sparse: workers with none are left out. O(the counted blocks)."""
        return disk_only_counts(block_hashes, counts, self._masks, _BIT[Tier.DISK])

    def computing_any(self, block_hashes: Sequence[BlockHash]) -> dict[WorkerId, set[str]]:
        """`computing` for every worker at once, sparse (the workers where it is not empty)."""
        return self._pending.computing_any(block_hashes)

    def locate(self, block_hash: BlockHash) -> dict[WorkerId, frozenset[Tier]]:
        """The workers holding `block_hash`, each with the tiers it holds it in."""
        return {w: _tiers(mask) for w, mask in self._masks(block_hash).items()}

    def holdings(self, worker_id: WorkerId) -> dict[BlockHash, frozenset[Tier]]:
        """Everything the index believes `worker_id` holds (a copy)."""
        return {h: _tiers(self._masks(h)[worker_id]) for h in self._by_worker.get(worker_id, ())}

    def workers(self) -> list[WorkerId]:
        """Known workers, sorted (including those with no blocks)."""
        return sorted(self._by_worker)

    def stats(self) -> IndexStats:
        return IndexStats(len(self._blocks), sum(len(h) for h in self._by_worker.values()),
                          len(self._by_worker), self._applied, self._pending.num_pending())

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        check_holders(self._entries(), self._by_worker, self._holders)
        held_asks, any_asks = self._recount()
        for w in set(held_asks) | set(self._held_asks.keys()):
            self._held_asks.tally(w).check(held_asks.get(w, Tally()), w)
        self._any_asks.check(any_asks, "the distinct blocks")
        assert self._asked.keys() == self._asked_at.keys(), "the two ask maps name different blocks"
        for h in self._asked:
            assert h in self._blocks or h in self._pending.by_block, \
                f"ask count kept for {h:032x}, held and computed nowhere"
        self._pending.check(self._holders)

    def _new_held(self) -> Any:
        """A worker's (empty) container of the blocks it holds: a set here."""
        return set()

    def _holders(self, h: BlockHash) -> Collection[WorkerId]:
        """The workers holding `h` in any tier (the storage's own view: do not mutate)."""
        return self._blocks.get(h, ())

    def _masks(self, h: BlockHash) -> dict[WorkerId, int]:
        """{worker: tier mask} of the workers holding `h` (the storage's own view: do not mutate)."""
        return self._blocks.get(h, {})

    def _entries(self) -> Iterator[tuple[BlockHash, WorkerId, int]]:
        """Every (block, worker, tier mask) entry of the map."""
        for h, holders in self._blocks.items():
            assert holders, f"block {h:032x} has an empty holder map"
            for w, mask in holders.items():
                yield h, w, mask

    def _drop(self, worker_id: WorkerId, hashes: Iterable[BlockHash], bits: int, evicted: bool = True) -> None:
        """Drop `bits` of `worker_id`'s entries for `hashes`; an entry that goes becomes pending for
        the requests running there that ask for it when `evicted` (they compute it), else they
        stop asking for it."""
        held = self._by_worker.get(worker_id)
        if held is None:
            return
        for h in list(hashes):  # `hashes` may be `held` itself
            holders = self._blocks.get(h)
            if holders is None or worker_id not in holders:
                continue
            mask = holders[worker_id] & ~bits
            if mask:
                holders[worker_id] = mask
                continue
            del holders[worker_id]
            held.discard(h)
            self._count_held(worker_id, h, -1)
            self._pending.lost(worker_id, h, evicted)      # it was held, so pending nowhere on the worker
            if not holders:
                del self._blocks[h]
                self._count_any(h, -1)
                self._forget_asks(h)
