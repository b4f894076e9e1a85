"""`best_peer_hint` walks the holders once, unsorted: the peer it names does not depend on the
order of the map it is given (ties go to the lowest id, as when it walked them sorted)."""
from __future__ import annotations

import itertools
import random

from contracts.requests import PeerHint
from router.routing.pick import best_peer_hint
from router.routing.types import WorkerId


def _sorted_walk(chosen: WorkerId, counts: dict[WorkerId, int], peers: dict[WorkerId, str],
                 max_blocks: int) -> PeerHint | None:
    """The hint as the sorted walk gave it."""
    if chosen not in peers:
        return None
    own, best = min(counts.get(chosen, 0), max_blocks), None
    for w in sorted(counts):
        if w != chosen and w in peers and min(counts[w], max_blocks) > own and (
                best is None or min(counts[w], max_blocks) > best.num_blocks):
            best = PeerHint(w, peers[w], min(counts[w], max_blocks))
    return best


def test_the_hint_is_the_sorted_walks_whatever_the_order() -> None:
    rng = random.Random(3)
    ids = [WorkerId(f"w{i}") for i in range(7)]
    for _ in range(300):
        counts = {w: rng.choice([0, 2, 5, 5, 9]) for w in ids if rng.random() < 0.8}
        peers = {w: f"h:{w}" for w in ids if rng.random() < 0.7}
        chosen, cap = rng.choice(ids), rng.choice([3, 5, 20])
        want = _sorted_walk(chosen, counts, peers, cap)
        for order in itertools.islice(itertools.permutations(list(counts.items())), 6):
            assert best_peer_hint(chosen, dict(order), peers, cap) == want
        assert best_peer_hint(chosen, dict(reversed(list(counts.items()))), peers, cap) == want
