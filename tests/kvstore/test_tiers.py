"""HostTier: bit-exact round trips with the device pool, LRU order, events, and a hypothesis
state machine against an OrderedDict model (integrity after every step)."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import AllBlocksCleared, BlockId, BlockPool, BlockRemoved, BlockStored
from kvstore.tensors import KVTensors
from kvstore.tiers import HostTier


def layout(dtype: str = "fp32") -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype=dtype)


def filled(lay: KVLayout, num_blocks: int, seed: int = 0) -> KVTensors:
    kv = KVTensors(lay, num_blocks)
    g = torch.Generator().manual_seed(seed)
    if kv.dtype == torch.uint8:
        kv.kv.copy_(torch.randint(0, 256, kv.kv.shape, generator=g, dtype=torch.uint8))
    else:
        kv.kv.copy_(torch.randn(kv.kv.shape, generator=g).to(kv.dtype))
    return kv


def H(i: int) -> BlockHash:
    return BlockHash(0x1000 + i)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int4", "fp8"])
def test_offload_onload_round_trip_is_bit_exact(dtype: str) -> None:
    lay = layout(dtype)
    dev = filled(lay, 6)
    tier = HostTier(lay, 4)
    assert tier.nbytes == 4 * lay.bytes_per_block
    assert tier.offload(dev, [BlockId(5), BlockId(1), BlockId(3)], [H(5), H(1), H(3)]) == 3
    assert tier.match_prefix([H(5), H(1), H(3), H(9)]) == 3
    assert tier.match_prefix([H(1), H(5)]) == 2 and tier.match_prefix([H(9), H(1)]) == 0
    other = KVTensors(lay, 6)
    tier.onload(other, [H(3), H(5)], [BlockId(0), BlockId(2)])
    assert torch.equal(other.kv[:, :, 0], dev.kv[:, :, 3])
    assert torch.equal(other.kv[:, :, 2], dev.kv[:, :, 5])
    assert not other.kv[:, :, [1, 3, 4, 5]].any()
    tier.check_integrity()


def test_lru_evicts_oldest_and_refresh_moves_to_young_end() -> None:
    lay = layout()
    dev = filled(lay, 8)
    tier = HostTier(lay, 3)
    tier.set_event_recording(True)
    tier.offload(dev, [BlockId(0), BlockId(1), BlockId(2)], [H(0), H(1), H(2)])
    assert tier.offload(dev, [BlockId(0)], [H(0)]) == 0        # held: refreshed, no copy
    tier.offload(dev, [BlockId(3)], [H(3)])                       # evicts H(1), the oldest
    assert tier.cached_hashes() == [H(2), H(0), H(3)]
    tier.read([H(2)])                                             # a read refreshes too
    tier.offload(dev, [BlockId(4), BlockId(5)], [H(4), H(5)])   # evicts H(0), H(3)
    assert tier.cached_hashes() == [H(2), H(4), H(5)]
    ev = tier.take_events()
    assert [type(e) for e in ev[:3]] == [BlockStored] * 3
    removed = [e.block_hash for e in ev if isinstance(e, BlockRemoved)]
    assert removed == [H(1), H(0), H(3)]
    s = tier.stats()
    assert (s.offloaded, s.refreshed, s.evicted) == (6, 1, 3)
    # content follows the hash through slot reuse
    back = KVTensors(lay, 8)
    tier.onload(back, [H(2), H(4), H(5)], [BlockId(0), BlockId(1), BlockId(2)])
    assert torch.equal(back.kv[:, :, :3], dev.kv[:, :, [2, 4, 5]])
    tier.clear()
    assert tier.num_used_blocks == 0 and isinstance(tier.take_events()[-1], AllBlocksCleared)
    tier.check_integrity()


def test_more_blocks_than_the_tier_keeps_the_last_ones() -> None:
    lay = layout()
    dev = filled(lay, 8)
    tier = HostTier(lay, 2)
    assert tier.offload(dev, [BlockId(i) for i in range(5)], [H(i) for i in range(5)]) == 2
    assert tier.cached_hashes() == [H(3), H(4)]
    tier.check_integrity()


def test_store_from_a_peer_and_errors() -> None:
    lay = layout("int8")
    dev = filled(lay, 4)
    tier = HostTier(lay, 4)
    data = dev.gather_blocks([0, 1])
    assert tier.store([H(0), H(1)], data) == 2
    assert tier.store([H(1)], data[:, :, 1:]) == 0
    assert torch.equal(tier.read([H(0), H(1)]), data)
    with pytest.raises(KeyError):
        tier.read([H(7)])
    with pytest.raises(ValueError, match="hashes"):
        tier.offload(dev, [BlockId(0)], [H(0), H(1)])
    with pytest.raises(ValueError, match="repeats"):
        tier.offload(dev, [BlockId(2), BlockId(3)], [H(9), H(9)])
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier(lay, 0)
    with pytest.raises(ValueError, match="one block"):
        HostTier.for_budget(lay, lay.bytes_per_block - 1)
    assert HostTier.for_budget(lay, 3 * lay.bytes_per_block + 5).num_blocks == 3


def test_device_pool_evictions_land_in_the_tier() -> None:
    """BlockPool.on_evict → HostTier.offload: an evicted cached block survives in host memory."""
    lay = layout()
    dev = filled(lay, 4)
    tier = HostTier(lay, 8)
    pool = BlockPool(4, on_evict=lambda ids, hashes: tier.offload(dev, ids, hashes))
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, [H(0), H(1), H(2)])
    want = dev.gather_blocks(blocks).clone()
    pool.free_sequence(blocks)
    pool.allocate(4)                                # evicts all three cached blocks
    assert pool.num_cached_blocks == 0 and tier.match_prefix([H(0), H(1), H(2)]) == 3
    assert torch.equal(tier.read([H(0), H(1), H(2)]), want)


class TierMachine(RuleBasedStateMachine):
    """HostTier against an OrderedDict model: same LRU order, same content per hash."""

    NUM_SLOTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.lay = layout("fp16")
        self.dev = filled(self.lay, 6, seed=1)
        self.tier = HostTier(self.lay, self.NUM_SLOTS)
        self.model: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()

    def _model_put(self, h: BlockHash, data: torch.Tensor) -> None:
        if h in self.model:
            self.model.move_to_end(h)
            return
        if len(self.model) == self.NUM_SLOTS:
            self.model.popitem(last=False)
        self.model[h] = data

    @rule(ids=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
          keys=st.lists(st.integers(0, 9), min_size=3, max_size=3, unique=True))
    def offload(self, ids: list[int], keys: list[int]) -> None:
        hashes = [H(k) for k in keys[:len(ids)]]
        # a device block's content is a function of its hash in a real pool: write it so
        for b, h in zip(ids, hashes):
            self.dev.kv[:, :, b] = float(h % 97)
        self.tier.offload(self.dev, [BlockId(b) for b in ids], hashes)
        for b, h in zip(ids, hashes):
            self._model_put(h, self.dev.kv[:, :, b].clone())

    @rule(keys=st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True))
    def read(self, keys: list[int]) -> None:
        hashes = [H(k) for k in keys]
        n = self.tier.match_prefix(hashes)
        expect = 0
        for h in hashes:
            if h not in self.model:
                break
            expect += 1
        assert n == expect
        if n:
            got = self.tier.read(hashes[:n])
            for j, h in enumerate(hashes[:n]):
                assert torch.equal(got[:, :, j], self.model[h])
                self.model.move_to_end(h)

    @rule()
    def clear(self) -> None:
        self.tier.clear()
        self.model.clear()

    @invariant()
    def agrees(self) -> None:
        self.tier.check_integrity()
        assert self.tier.cached_hashes() == list(self.model)


TierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=20, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_tier_state_machine = TierMachine.TestCase


def test_offload_while_a_load_pins_the_tier_keeps_what_fits() -> None:
    # a load pins its host blocks while its device allocation evicts into this very tier
    # (found by test_store_state_machine): the youngest evicted blocks that fit are kept
    lay = layout()
    dev = filled(lay, 8)
    tier = HostTier(lay, 3)
    tier.offload(dev, [BlockId(0), BlockId(1), BlockId(2)], [H(0), H(1), H(2)])
    tier.pin([H(0), H(1)])
    assert tier.offload(dev, [BlockId(5), BlockId(6), BlockId(7)], [H(5), H(6), H(7)]) == 1
    assert tier.match_prefix([H(7)]) == 1 and tier.match_prefix([H(5)]) == tier.match_prefix([H(2)]) == 0
    assert tier.match_prefix([H(0), H(1)]) == 2
    tier.pin([H(7)])
    assert tier.offload(dev, [BlockId(4)], [H(4)]) == 0
    assert tier.store([H(9)], dev.kv[:, :, [3]]) == 0
    tier.unpin([H(0), H(1), H(7)])
    assert tier.offload(dev, [BlockId(4)], [H(4)]) == 1
    tier.check_integrity()
