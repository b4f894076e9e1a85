"""`BlockIndex.match_leading_pair` (router/index/lookup.py `leading_pair`) is the two
`match_leading` lookups it replaces in the routing view — with pending blocks and without —
on both index storages, random holders, partial chains, tiers and requests in flight."""
from __future__ import annotations

import random

import pytest

from kvstore.events import Tier, WorkerId
from kvstore.keys import BlockHash
from router.index.blocks import BlockIndex
from router.index.compact import CompactBlockIndex


@pytest.mark.parametrize("storage", [BlockIndex, CompactBlockIndex])
def test_the_pair_is_both_leading_lookups(storage: type[BlockIndex]) -> None:
    rng = random.Random(11)
    index = storage()
    workers = [WorkerId(f"w{i}") for i in range(30)]
    chains = [tuple(BlockHash(rng.getrandbits(128)) for _ in range(rng.randrange(1, 20))) for _ in range(12)]
    busy_seen = 0
    for step in range(400):
        chain, w = rng.choice(chains), rng.choice(workers)
        roll = rng.random()
        if roll < 0.5:       # a worker stores a leading run of the chain, perhaps with a gap
            held = list(chain[:rng.randrange(len(chain) + 1)])
            if held and rng.random() < 0.3:
                held.pop(rng.randrange(len(held)))
            index.add(w, held, rng.choice([Tier.DEVICE, Tier.HOST, Tier.DISK]))
        elif roll < 0.7:
            index.discard(w, rng.sample(chain, rng.randrange(len(chain) + 1)), Tier.DEVICE)
        elif roll < 0.9:     # a request in flight computes the chain there
            index.add_pending(f"r{step}", w, chain, expires_at=1e9)
        else:
            index.drop_pending(f"r{rng.randrange(step + 1)}")
        for route in (chain, chain[:rng.randrange(len(chain) + 1)], rng.choice(chains)):
            cached, stored = index.match_leading_pair(route)
            assert cached == index.match_leading(route), step
            assert stored == index.match_leading(route, pending=False), step
            busy_seen += cached != stored
    assert busy_seen > 50           # pending blocks changed the counts often
