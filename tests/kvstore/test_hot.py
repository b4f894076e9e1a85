"""The store's hit tracker (kvstore/hot.py) and what a peer may read of a store: the hottest
blocks in any tier, and blocks of the disk tier read back for a peer (KVStore.read)."""
from __future__ import annotations

import time

import torch

from kvstore.disk_record import DiskSpec, slot_bytes
from kvstore.hot import HitTracker
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.store import KVStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, kv_cache_dtype="fp32")
FP = b"hot-blocks-fp-16"


def H(i: int) -> BlockHash:
    return BlockHash(0x9000 + i)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_hottest_ranks_by_decayed_hits_parents_first():
    clock = Clock()
    hot = HitTracker(half_life_s=10.0, clock=clock)
    for _ in range(3):
        hot.hit([H(1), H(2)])           # an old chain, hit three times
    clock.t = 30.0                      # three half-lives later: 3 hits weigh 3/8
    hot.hit([H(1), H(5), H(6)])         # a new chain sharing the root block
    assert abs(hot.score(H(2)) - 3 / 8) < 1e-9 and abs(hot.score(H(5)) - 1.0) < 1e-9
    assert hot.hottest(lambda h: True, 10) == [H(1), H(5), H(6), H(2)]
    assert hot.hottest(lambda h: h != H(5), 2) == [H(1), H(6)]
    assert hot.hottest(lambda h: True, 0) == []


def test_rebase_keeps_the_order_and_the_bound_forgets_the_coldest():
    clock = Clock()
    hot = HitTracker(half_life_s=1.0, max_entries=8, clock=clock)
    hot.hit([H(1)])
    clock.t = 100.0                      # past the rebase exponent
    hot.hit([H(2)])
    hot.hit([H(2)])
    assert hot.hottest(lambda h: True, 5) == [H(2), H(1)]
    for i in range(10, 20):
        clock.t += 0.1
        hot.hit([H(i)])
    assert len(hot) <= 8 and H(2) in hot.hottest(lambda h: True, 8)


def _store(tmp_path) -> KVStore:
    return KVStore(LAYOUT, 4, offload_bytes=2 * LAYOUT.bytes_per_block,
                   disk=DiskSpec(str(tmp_path), 32 * slot_bytes(LAYOUT.bytes_per_block), FP))


def _cache_chain(store: KVStore, hashes: list[BlockHash], fill: float, root: BlockHash | None = None) -> None:
    ids = store.allocate(len(hashes))
    for k, b in enumerate(ids):
        store.kv.kv[:, :, int(b)] = fill + k                     # [L, 2, num_blocks, bs, H, D]
    store.cache(ids, hashes, salt_root=root)
    store.free_sequence(ids)


def test_read_goes_on_from_device_to_host_to_disk_and_hottest_lists_every_tier(tmp_path):
    store = _store(tmp_path)
    try:
        root = BlockHash(0xA1)
        chain = [H(i) for i in range(8)]
        _cache_chain(store, chain[:4], 10.0, root)
        _cache_chain(store, chain[4:], 20.0, root)      # evicts the first four: host (2), then disk
        for _ in range(200):
            if store.disk is not None and store.disk.key_of(chain[2]) is not None:
                break
            time.sleep(0.01)
        assert store.disk is not None
        store.disk.flush(10)
        where = store.lookup(chain, root)
        assert where == ((), 2, 2) and store.disk.key_of(chain[2]) == (root, chain[2])   # host 2, disk 2
        held = store.read(chain, torch.device("cpu"))
        assert held.num_blocks == 8 and held.blocks is not None
        for k in range(8):                                       # the exact bytes of each block
            want = (10.0 if k < 4 else 20.0) + k % 4
            assert torch.all(held.blocks[:, :, k] == want), k
        assert store.read_now(chain, torch.device("cpu")) is None    # the run goes on on disk
        m = store.lookup(chain[:2], root)
        store.free_sequence(store.take(chain[:2], m, 2))          # a hit on the host run: onloaded
        assert store.hottest(16) == chain[:2]                    # only hit blocks are listed, parents first
        store.hot.hit(chain)
        store.disk.flush(10)
        assert store.hottest(16) == chain                        # device, host and disk alike
    finally:
        store.close()


def test_write_through_puts_cached_blocks_on_disk_and_a_new_store_finds_them(tmp_path):
    spec = DiskSpec(str(tmp_path), 32 * slot_bytes(LAYOUT.bytes_per_block), FP, write_through=True)
    store = KVStore(LAYOUT, 4, offload_bytes=2 * LAYOUT.bytes_per_block, disk=spec)
    root = BlockHash(0xB2)
    chain = [H(i) for i in range(3)]
    try:
        _cache_chain(store, chain, 5.0, root)            # nothing evicted: the device pool holds all
        assert store.disk is not None
        store.disk.flush(10)
        assert store.lookup(chain, root).device and store.disk.match_prefix(root, chain) == 3
    finally:
        store.close()
    again = KVStore(LAYOUT, 4, offload_bytes=2 * LAYOUT.bytes_per_block, disk=spec)   # a restart
    try:
        assert again.lookup(chain, root) == ((), 0, 3) and again.lookup(chain) == ((), 0, 0)
        held = again.read(chain, torch.device("cpu"))
        assert held.num_blocks == 3 and held.blocks is not None
        assert all(torch.all(held.blocks[:, :, k] == 5.0 + k) for k in range(3))
    finally:
        again.close()
