"""The cluster fill a copy of a prefix is priced at (router/index/asks.py `cluster_fill`): every
block a prompt asked for counts in full, fading with the traffic, not at its reuse rate."""
from __future__ import annotations

import pytest

from kvstore.events import EventType, Tier, WireEvent, WorkerId
from kvstore.keys import BlockHash
from router.index.asks import Ask, Decay, Tally, cluster_fill
from router.index.compact import CompactBlockIndex

A, B = WorkerId("a"), WorkerId("b")


def _stored(*hashes: BlockHash) -> WireEvent:
    return WireEvent(EventType.STORED, hashes, None, Tier.DEVICE)


def test_held_counts_every_block_in_full_at_its_weight():
    decay = Decay(1.0)
    tally = Tally()
    tally.count(Ask(2, 0, 0.0), decay.weight(Ask(2, 0, 0.0)), +1)      # shared
    for depth in (1, 2, 2):
        tally.count(Ask(1, depth, 0.0), 1.0, +1)                       # asked once: in full
    assert tally.held(decay.scale()) == 4.0
    assert tally.expected([10, 10, 10], [0, 0, 0], decay.scale()) == pytest.approx(1 + 3 / 12)
    decay.now = 1.0                                                     # one half-life later
    assert tally.held(decay.scale()) == pytest.approx(2.0)


def test_a_workload_whose_prefixes_were_each_asked_once_fills_the_pools_in_full():
    """Eight prefixes of 4 blocks, each asked for by one prompt so far, on two 20-block pools:
    they fill 32 of the 40 blocks. The expected shared count (what the copy was priced at
    before) sees a fraction of that, and would let a replica take the last free blocks."""
    index = CompactBlockIndex()
    index.set_capacity(40)
    for p in range(8):
        blocks = tuple(BlockHash(0x100 * (p + 1) + d) for d in range(4))
        index.add_pending(f"r{p}", (A, B)[p % 2], blocks, expires_at=100.0)
        index.apply((A, B)[p % 2], _stored(*blocks))
    fill = cluster_fill(index, 40)
    # the clock moved 32 / 40 of a pool-full, the first prompts' blocks faded a little
    assert 0.8 * 2 ** (-0.8 / 4) < fill < 0.8
    assert index.distinct_shared_blocks() / 40 < 0.5 * fill            # each depth's rate: 1 / 10
    assert cluster_fill(index, 0) == 0.0
    assert cluster_fill(index, 10) == 1.0                               # capped at a full cluster
