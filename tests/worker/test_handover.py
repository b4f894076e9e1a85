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


def _stats(host_used: int, host_all: int, disk: object = None) -> object:
    from worker.engine.config import EngineStats
    return EngineStats(0, 0, 0, 0, 0, 0, 0, 0, num_host_blocks=host_used, host_num_blocks=host_all,
                       disk=disk)  # type: ignore[arg-type]


def test_handover_room_is_the_free_host_room_or_with_a_disk_tier_the_whole_host_tier(tmp_path):
    """A hand-over into a full host tier displaces its LRU blocks; with a disk tier they go to disk
    (nothing lost), so the room is the whole host tier; without one only the free slots."""
    import torch

    from kvstore.disk_record import DiskSpec, slot_bytes
    from kvstore.layout import KVLayout
    from kvstore.store import KVStore
    from worker.server.responses import handover_room

    assert handover_room(_stats(6, 8)) == 2 and handover_room(_stats(8, 8)) == 0
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, kv_cache_dtype="fp32")
    store = KVStore(layout, 4, offload_bytes=2 * layout.bytes_per_block,
                    disk=DiskSpec(str(tmp_path), 32 * slot_bytes(layout.bytes_per_block), b"fingerprint-0009"))
    try:
        assert store.disk is not None and store.host is not None
        assert handover_room(_stats(2, 2, store.disk.stats())) == 2
        # the host tier full of the receiver's own blocks; a peer's two blocks are staged into it
        own = [H(i) for i in range(2)]
        store.stage(own, torch.full((2, 2, 2, 4, 2, 4), 3.0))
        assert store.host.num_used_blocks == 2
        theirs = [H(100 + i) for i in range(2)]
        assert store.stage(theirs, torch.full((2, 2, 2, 4, 2, 4), 7.0)) == 2
        store.disk.flush(10)
        assert not any(h in store.host for h in own) and all((None, h) in store.disk for h in own)
        for chain, value in ((own, 3.0), (theirs, 7.0)):           # the displaced ones from disk
            held = store.read(chain, torch.device("cpu"))
            assert held.num_blocks == 2 and held.blocks is not None and bool((held.blocks == value).all())
        store.disk.close()
        assert handover_room(_stats(2, 2, store.disk.stats())) == 0   # a tier turned off: free room only
    finally:
        store.close()
