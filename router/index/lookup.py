"""The block index's prefix lookups (router/index/blocks.py `BlockIndex.match_leading`,
`disk_only`), over the storage's own views: the holders of a block, their tier masks, and the
requests computing it (pending). Sparse: they touch the prompt's blocks and their holders only,
whatever the number of workers."""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from kvstore.events import WorkerId
from kvstore.keys import BlockHash

Counts = dict[WorkerId, int]


def leading_counts(block_hashes: Sequence[BlockHash], holders_of: Callable[[BlockHash], Collection[WorkerId]],
                   computing: Mapping[BlockHash, Collection[WorkerId]],
                   among: Collection[WorkerId] | None = None) -> dict[WorkerId, int]:
    """How many leading `block_hashes` each worker holds (`holders_of`) or computes
    (`computing`), for the workers with at least the first (of `among` only, if given: the
    work is then O(blocks × `among`), whatever the number of holders): the count stops at its
    first missing block."""
    nobody: tuple[WorkerId, ...] = ()
    counts: dict[WorkerId, int] = {}
    matching: set[WorkerId] | None = None
    num_matched = 0
    for h in block_hashes:
        holders = holders_of(h)
        busy = computing.get(h, nobody)
        if not holders and not busy:
            break
        if matching is None:
            if among is None:
                matching = set(holders)
                matching.update(busy)
            else:
                matching = {w for w in among if w in holders or w in busy}
                if not matching:
                    break
        else:       # the workers that stop matching here, in set operations (C, not a loop here)
            gone = matching.difference(holders)
            if gone and busy:
                gone.difference_update(busy)
            if gone:
                for w in gone:
                    counts[w] = num_matched
                matching -= gone
                if not matching:
                    break
        num_matched += 1
    for w in matching or ():
        counts[w] = num_matched
    return counts


def leading_pair(block_hashes: Sequence[BlockHash], holders_of: Callable[[BlockHash], Collection[WorkerId]],
                 computing: Mapping[BlockHash, Collection[WorkerId]]) -> tuple[Counts, Counts]:
    """`leading_counts` with `computing` and without it, in one pass over the holders: a
    worker computing none of the prompt's blocks has the same count in both, so the second
    count is redone only for the workers computing one (few: the requests in flight)."""
    stored = leading_counts(block_hashes, holders_of, {})
    busy: set[WorkerId] = set()
    for h in block_hashes:
        if (b := computing.get(h)) is not None:
            busy.update(b)
    if not busy:
        return dict(stored), stored
    cached = dict(stored)
    cached.update(leading_counts(block_hashes, holders_of, computing, among=busy))
    return cached, stored


def disk_only_counts(block_hashes: Sequence[BlockHash], counts: Mapping[WorkerId, int],
                     masks_of: Callable[[BlockHash], Mapping[WorkerId, int]], disk_bit: int) -> dict[WorkerId, int]:
    """Of each worker's `counts[w]` leading blocks, those whose tier mask there is `disk_bit`
    alone (held on disk only); workers with none left out."""
    out: dict[WorkerId, int] = {}
    for w, n in counts.items():
        k = sum(1 for h in block_hashes[:n] if masks_of(h).get(w, 0) == disk_bit)
        if k:
            out[w] = k
    return out
