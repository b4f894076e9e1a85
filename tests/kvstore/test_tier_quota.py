"""Per-tenant caps below the device pool (kvstore/quota.py `OwnerLRU`): the host tier and the
disk tier drop the oldest blocks of an owner over its cap before anyone else's, and an owner
follows a block from the device pool into the host tier and from there to disk (KVStore)."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.disk import DiskTier
from kvstore.disk_record import DiskSpec, slot_bytes
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import BlockId
from kvstore.quota import OwnerLRU
from kvstore.store import KVStore
from kvstore.tensors import KVTensors
from kvstore.tiers import HostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="fp32")


def H(i: int) -> BlockHash:
    return BlockHash(0x2000 + i)


def test_the_host_tier_drops_an_owner_over_its_cap_first() -> None:
    dev = KVTensors(LAYOUT, 16)
    tier = HostTier(LAYOUT, 6, max_cached_frac=0.5)        # cap: 3 blocks per owner
    tier.offload(dev, [BlockId(0), BlockId(1)], [H(0), H(1)], ["alpha", "alpha"])   # the oldest
    tier.offload(dev, [BlockId(2), BlockId(3), BlockId(4), BlockId(5)], [H(2), H(3), H(4), H(5)], ["beta"] * 4)
    assert tier.quota.usage() == {"alpha": 2, "beta": 4}
    # full: two new beta blocks drop beta's oldest (beta is over its cap), not alpha's older ones
    tier.offload(dev, [BlockId(6), BlockId(7)], [H(6), H(7)], ["beta", "beta"])
    assert set(tier.cached_hashes()) == {H(0), H(1), H(4), H(5), H(6), H(7)}
    # beta at 4 > 3 still: the next unowned block takes beta's oldest, then, at its cap, the plain LRU
    tier.offload(dev, [BlockId(8), BlockId(9)], [H(8), H(9)])
    assert set(tier.cached_hashes()) == {H(1), H(5), H(6), H(7), H(8), H(9)}
    tier.check_integrity()
    tier.quota.set_cap("beta", 1)
    tier.offload(dev, [BlockId(10)], [H(10)], ["alpha"])
    assert H(5) not in tier and tier.quota.usage() == {"alpha": 2, "beta": 2}
    tier.clear()
    assert tier.quota.usage() == {}
    tier.check_integrity()


def test_a_pinned_block_of_an_owner_over_its_cap_is_kept() -> None:
    dev = KVTensors(LAYOUT, 8)
    tier = HostTier(LAYOUT, 3, max_cached_frac=0.34)       # cap 1
    tier.offload(dev, [BlockId(0), BlockId(1), BlockId(2)], [H(0), H(1), H(2)], ["beta"] * 3)
    tier.pin([H(0)])
    tier.offload(dev, [BlockId(3)], [H(3)], ["alpha"])
    assert H(0) in tier and H(1) not in tier
    tier.check_integrity()


def test_the_disk_tier_deletes_an_owner_over_its_cap_first(tmp_path: Path) -> None:
    shape = (2, 2, 4, 2, 8)
    record = slot_bytes(LAYOUT.bytes_per_block)
    tier = DiskTier.open(tmp_path, 4 * record, LAYOUT, torch.float32, shape, b"fingerprint-0002", max_cached_frac=0.5)
    try:
        for i, owner in enumerate(["alpha", "beta", "beta", "beta"]):
            assert tier.write_behind((None, H(i)), torch.full(shape, float(i)), owner)
        tier.flush()
        assert tier.quota.usage() == {"alpha": 1, "beta": 3}
        assert tier.write_behind((None, H(4)), torch.full(shape, 4.0), "beta")
        tier.flush()
        # beta (3 > 2) loses its oldest record; alpha's, older still, stays
        assert sorted(tier.cached_hashes()) == [H(0), H(2), H(3), H(4)]
        tier.set_owner_cap("beta", None)
        assert tier.write_behind((None, H(5)), torch.full(shape, 5.0))   # no owner
        tier.flush()
        assert sorted(tier.cached_hashes()) == [H(0), H(3), H(4), H(5)]
        tier.check_integrity()
    finally:
        tier.close()


def test_an_owner_follows_its_blocks_from_the_device_pool_to_host_and_disk(tmp_path: Path) -> None:
    spec = DiskSpec(str(tmp_path), 64 * (slot_bytes(LAYOUT.bytes_per_block)), b"fingerprint-0003")
    store = KVStore(LAYOUT, 4, offload_bytes=4 * LAYOUT.bytes_per_block, disk=spec, max_cached_frac=0.5)
    try:
        owners = ["alpha", "alpha", "beta", "beta", "beta", "beta", "beta", "beta", "beta", "beta", "beta"]
        for n, owner in enumerate(owners):
            ids = store.allocate(1)
            store.cache(ids, [H(n)], owner=owner)
            store.free_sequence(ids)
        assert store.host is not None and store.disk is not None
        store.disk.flush()
        # each tier's cap is 2 (half of 4): beta's flood of 9 blocks leaves alpha's 2 served
        match = store.lookup([H(0)]), store.lookup([H(1)])
        assert all(m.num_blocks == 1 for m in match)
        # the pool counts a block once cached: beta is over its cap by at most the last one
        assert store.pool.owner_usage()["beta"].num_cached_blocks <= 3
        assert all(store.host.quota.owner_of(h) == owners[h - H(0)] for h in store.host.cached_hashes())
        assert store.disk.quota.usage() == {"beta": len(store.disk.cached_hashes())} != {"beta": 0}
        store.check_integrity()
    finally:
        if store.disk is not None:
            store.disk.close()


class OwnerLRUMachine(RuleBasedStateMachine):
    """`OwnerLRU` beside a plain model: after each step its integrity holds against the tier's
    order, and `victims` are exactly the oldest unpinned entries of owners over their cap."""

    def __init__(self) -> None:
        super().__init__()
        self.quota: OwnerLRU[int] = OwnerLRU(8, 0.25)    # default cap 2
        self.lru: OrderedDict[int, str | None] = OrderedDict()

    @rule(key=st.integers(0, 15), owner=st.sampled_from([None, "a", "b", "c"]))
    def add(self, key: int, owner: str | None) -> None:
        self.lru.pop(key, None)
        self.lru[key] = owner
        self.quota.added(key, owner)

    @rule(key=st.integers(0, 15))
    def touch(self, key: int) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)
            self.quota.touched(key)

    @rule(key=st.integers(0, 15))
    def remove(self, key: int) -> None:
        if key in self.lru:
            del self.lru[key]
            self.quota.removed(key)

    @rule(owner=st.sampled_from(["a", "b"]), cap=st.one_of(st.none(), st.integers(0, 4)))
    def set_cap(self, owner: str, cap: int | None) -> None:
        self.quota.set_cap(owner, cap)

    @rule(n=st.integers(1, 6), pinned=st.sets(st.integers(0, 15), max_size=3))
    def victims(self, n: int, pinned: set[int]) -> None:
        got = self.quota.victims(n, pinned)
        assert len(got) <= n and not set(got) & pinned
        for owner in {self.lru[k] for k in got}:
            assert owner is not None
            mine = [k for k in got if self.lru[k] == owner]
            held = [k for k, o in self.lru.items() if o == owner]
            assert len(mine) <= len(held) - self.quota.cap(owner)                  # only down to its cap
            assert mine == [k for k in held if k not in pinned][:len(mine)]        # its oldest first

    @invariant()
    def consistent(self) -> None:
        self.quota.check_integrity(list(self.lru))
        want: dict[str, int] = {}
        for owner in self.lru.values():
            if owner:
                want[owner] = want.get(owner, 0) + 1
        assert self.quota.usage() == dict(sorted(want.items()))


TestOwnerLRU = OwnerLRUMachine.TestCase
TestOwnerLRU.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_owner_lru_rejects_bad_caps() -> None:
    with pytest.raises(ValueError, match="max_cached_frac"):
        OwnerLRU(4, 0.0)
    with pytest.raises(ValueError, match="max_cached_blocks"):
        OwnerLRU(4).set_cap("a", -1)


def test_blocks_written_through_to_disk_keep_their_owner(tmp_path: Path) -> None:
    spec = DiskSpec(str(tmp_path), 8 * (slot_bytes(LAYOUT.bytes_per_block)), b"fingerprint-0004", True)
    store = KVStore(LAYOUT, 4, offload_bytes=4 * LAYOUT.bytes_per_block, disk=spec, max_cached_frac=0.5)
    assert store.disk is not None
    try:
        for n, owner in enumerate(["alpha"] * 2 + ["beta"] * 10):
            ids = store.allocate(1)
            store.cache(ids, [H(n)], owner=owner)
            store.free_sequence(ids)
            store.disk.flush()
        # written as cached (write-through), each record counted for its tenant: the tier holds 8,
        # and beta, over its cap of 4 once it is full, gives its own oldest: alpha's two stay
        assert store.disk.quota.usage() == {"alpha": 2, "beta": 6}
        assert {H(0), H(1)} <= set(store.disk.cached_hashes())
        store.check_integrity()
    finally:
        store.disk.close()
