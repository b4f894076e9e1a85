"""The plan of a drain hand-over and a warm start (worker/peer/handover.py): who gets which
hashes, the merge of peers' hot lists, the bandwidth bound, the chunked receiving loop."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore.keys import BlockHash
from worker.peer.handover import PeerRoom, RateLimit, interleave, pull_chunks, split_by_room


def H(i: int) -> BlockHash:
    return BlockHash(i)


def test_split_gives_contiguous_slices_by_room_most_room_first():
    hot = [H(i) for i in range(10)]
    peers = [PeerRoom("a", "a:1", 3), PeerRoom("b", "b:1", 5), PeerRoom("c", "c:1", 0)]
    assert split_by_room(hot, peers) == [(peers[1], hot[:5]), (peers[0], hot[5:8])]
    assert split_by_room(hot[:2], peers) == [(peers[1], hot[:2])]
    assert split_by_room(hot, [PeerRoom("c", "c:1", 0)]) == []


def test_interleave_round_robin_dedupes_skips_and_bounds():
    lists = [("a", [H(1), H(2), H(3)]), ("b", [H(1), H(7), H(8)])]
    assert interleave(lists, 10) == {"a": [H(1), H(2), H(3)], "b": [H(7), H(8)]}
    assert interleave(lists, 3) == {"a": [H(1), H(2)], "b": [H(7)]}
    assert interleave(lists, 10, skip=lambda h: h in (H(1), H(8))) == {"a": [H(2), H(3)], "b": [H(7)]}
    assert interleave([], 5) == {}


def test_rate_limit_spaces_moves_to_the_bound():
    t = [0.0]
    limit = RateLimit(100.0, clock=lambda: t[0])
    assert limit.delay_s(100) == 1.0          # 100 bytes at 100 B/s: due at t = 1
    t[0] = 1.5
    assert limit.delay_s(100) == 0.5          # 200 bytes due at t = 2
    assert RateLimit(0).delay_s(10**9) == 0.0


def test_pull_chunks_counts_short_chunks_and_stops_at_the_deadline():
    asked: list[list[BlockHash]] = []

    async def pull(part: Sequence[BlockHash]) -> int:
        asked.append(list(part))
        return len(part) - (1 if H(5) in part else 0)     # the holder lost block 5

    got = asyncio.run(pull_chunks(pull, [H(i) for i in range(10)], 1000, chunk_blocks=4))
    assert asked == [[H(0), H(1), H(2), H(3)], [H(4), H(5), H(6), H(7)], [H(8), H(9)]]
    assert (got.num_blocks, got.num_short) == (9, 1)
    asked.clear()
    got = asyncio.run(pull_chunks(pull, [H(i) for i in range(10)], 1000, deadline=0.0, chunk_blocks=4))
    assert asked == [] and got.num_blocks == 0
