"""Generation fencing: events of an earlier incarnation of a worker (a lower epoch) are dropped
by the block index and by the consumer's cursor; a higher one replaces what the worker held."""
from __future__ import annotations

from kvstore.events import EventType, Tier, Verdict, WireEvent, WorkerCursor, WorkerId, inventory_events
from kvstore.keys import BlockHash
from router.index.blocks import BlockIndex
from router.index.gate import GatedIndex

W = WorkerId("w0")


def stored(*hashes: int, tier: Tier = Tier.DEVICE) -> WireEvent:
    return WireEvent(EventType.STORED, tuple(BlockHash(h) for h in hashes), None, tier)


def test_stale_generation_event_is_dropped_and_the_index_stays_exact() -> None:
    index = BlockIndex()
    index.apply(W, stored(1, 2), generation=1)
    # the worker restarts (generation 2) and publishes its inventory: disk-held blocks survive
    for e in inventory_events({Tier.DISK: [BlockHash(2), BlockHash(3)]}):
        index.apply(W, e, generation=2)
    assert index.holdings(W) == {2: frozenset({Tier.DISK}), 3: frozenset({Tier.DISK})}
    # a late event of the first incarnation (a process still winding down) is fenced off
    index.apply(W, stored(1, 9), generation=1)
    index.apply(W, WireEvent(EventType.REMOVED, (BlockHash(3),), None, Tier.DISK), generation=1)
    assert set(index.holdings(W)) == {2, 3} and index.num_stale_events == 2
    index.check_integrity()


def test_a_higher_generation_forgets_what_the_earlier_one_held() -> None:
    index = BlockIndex()
    index.apply(W, stored(1, 2), generation=4)
    index.apply(W, stored(7), generation=5)              # no inventory yet: the old blocks are gone anyway
    assert set(index.holdings(W)) == {7}
    index.apply(W, stored(8))                            # no generation: not fenced (an index fed by hand)
    assert set(index.holdings(W)) == {7, 8}


def test_gated_index_passes_the_generation_on() -> None:
    gated = GatedIndex(BlockIndex())
    gated.apply(W, stored(1), 3)
    gated.apply(W, stored(2), 2)
    assert set(gated.index.holdings(W)) == {1} and gated.index.num_stale_events == 1


def test_cursor_calls_an_earlier_epoch_stale_and_stays_put() -> None:
    c = WorkerCursor()
    assert c.check(3, 1) is Verdict.NEXT and c.check(3, 2) is Verdict.NEXT
    assert c.check(2, 7) is Verdict.STALE                # an earlier incarnation's entry
    assert c.check(3, 3) is Verdict.NEXT                 # the cursor did not move past it
    c = WorkerCursor(record_epoch=5)                     # the registry already shows epoch 5
    assert c.check(4, 1) is Verdict.STALE and c.check(5, 1) is Verdict.NEXT
