"""Blocks a running request asks for (router/index/blocks.py): the whole prompt of a request
in flight on a worker is held there or computed there. A worker evicts blocks when a step
begins and reports it when the step ends, so a request sent in between is told its prefix is
held, finds part of it gone, and computes that part again: the `BlockRemoved` that arrives while
it runs makes those blocks pending for it, and the next request of the prefix is predicted the
whole prefix (it waits on the first one's prefill) instead of the part the index still lists."""
from __future__ import annotations

import pytest

from kvstore.events import EventType, Tier, WireEvent, WorkerId
from kvstore.keys import BlockHash, block_hashes
from router.index.blocks import BlockIndex
from router.index.compact import CompactBlockIndex

SALT = b"asking-test"
BS = 16
W0, W1 = WorkerId("w0"), WorkerId("w1")


def _prompt(prefix: int, question: int) -> tuple[BlockHash, ...]:
    ids = [1000 + prefix] * (8 * BS) + [5000 + question] * (2 * BS)
    return tuple(block_hashes(ids, BS, SALT))


def _event(kind: EventType, hashes: tuple[BlockHash, ...]) -> WireEvent:
    return WireEvent(kind, hashes, None, Tier.DEVICE)


@pytest.mark.parametrize("make", [BlockIndex, CompactBlockIndex])
def test_a_block_evicted_under_a_running_request_is_pending_for_it(make: type[BlockIndex]) -> None:
    index = make()
    first, second = _prompt(0, 0), _prompt(0, 1)
    index.apply(W0, _event(EventType.STORED, first[:8]))      # w0 holds the 8-block prefix
    index.apply(W1, _event(EventType.STORED, ()))
    index.add_pending("r1", W0, first, expires_at=160.0)      # sent while the index lists it held
    assert index.computing(W0, second) == set()
    # w0 had evicted the prefix's last 3 blocks before r1 took its blocks; the event comes now
    index.apply(W0, _event(EventType.REMOVED, first[5:8]))
    assert index.match_prefix(second, [W0], pending=False) == {W0: 5}
    assert index.match_prefix(second, [W0, W1]) == {W0: 8, W1: 0}   # r1 computes them again
    assert index.computing(W0, second) == {"r1"}
    index.check_integrity()
    # its BlockStored events confirm them
    index.apply(W0, _event(EventType.STORED, first))
    assert index.match_prefix(second, [W0], pending=False) == {W0: 8}
    assert index.stats().num_pending == 0
    index.check_integrity()
    # once r1 is done a block that goes is gone: r1 stores nothing more
    index.settle_pending("r1", 105.0)
    index.apply(W0, _event(EventType.REMOVED, first[7:8]))
    assert index.match_prefix(second, [W0]) == {W0: 7}
    index.check_integrity()


@pytest.mark.parametrize("make", [BlockIndex, CompactBlockIndex])
def test_a_follower_computes_what_its_failed_leader_would_have(make: type[BlockIndex]) -> None:
    index = make()
    lead, follower, third = _prompt(1, 0), _prompt(1, 1), _prompt(1, 2)
    index.add_pending("lead", W0, lead, expires_at=160.0)
    index.add_pending("follower", W0, follower, expires_at=160.0)   # waits on the leader's prefix
    assert index.computing(W0, third) == {"lead"}
    index.drop_pending("lead")                                      # it failed before its prefill
    assert index.match_prefix(third, [W0]) == {W0: 8}
    assert index.computing(W0, third) == {"follower"}
    index.check_integrity()
    index.drop_pending("follower")
    assert index.match_prefix(third, [W0]) == {W0: 0} and index.stats().num_pending == 0
    index.check_integrity()


def test_a_removed_worker_takes_its_requests_asks_with_it() -> None:
    index = CompactBlockIndex()
    prompt = _prompt(2, 0)
    index.apply(W0, _event(EventType.STORED, prompt[:8]))
    index.add_pending("r", W0, prompt, expires_at=160.0)
    index.remove_worker(W0)
    assert index.pending_requests() == [] and index.stats().num_pending == 0
    index.check_integrity()


@pytest.mark.parametrize("make", [BlockIndex, CompactBlockIndex])
def test_blocks_a_correction_drops_are_not_predicted_for_the_requests_asking_for_them(
        make: type[BlockIndex]) -> None:
    """A correction (router/routing/predictions.py) distrusts the worker's events: the blocks it
    drops are neither held nor pending there until the worker's inventory says otherwise."""
    index = make()
    first, second = _prompt(3, 0), _prompt(3, 1)
    index.apply(W0, _event(EventType.STORED, first[:8]))
    index.add_pending("r1", W0, first, expires_at=160.0)
    index.forget(W0, first[5:8])
    assert index.match_prefix(second, [W0]) == {W0: 5} and index.computing(W0, second) == set()
    index.check_integrity()
    index.apply(W0, _event(EventType.REMOVED, first[:5]))   # an eviction: r1 computes these
    assert index.match_prefix(second, [W0]) == {W0: 5} and index.computing(W0, second) == {"r1"}
    index.check_integrity()
