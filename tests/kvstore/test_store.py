"""KVStore: one lookup over device pool and host tier, take/stage/read with bit-exact
content, one ordered event log of both tiers, integrity — and a hypothesis state machine in
which every block's content is a function of its hash (so a reuse that returns the wrong
bytes shows), with integrity and "nothing in use is evicted" checked after every step."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import OutOfBlocks
from kvstore.events import EventType, Tier, TieredEvent, from_tiered_events
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import BlockId, BlockRemoved, BlockStored
from kvstore.store import KVStore
from kvstore.store_types import Match, NoHostTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, kv_cache_dtype="fp32")
CPU = torch.device("cpu")


def H(i: int) -> BlockHash:
    return BlockHash(0x5000 + i)


def content(h: BlockHash) -> float:
    return float(h % 251)


def write(store: KVStore, block_ids: list[BlockId], hashes: list[BlockHash]) -> None:
    """Compute blocks: their K/V is a function of their hash (what a real prefill gives)."""
    for b, h in zip(block_ids, hashes):
        store.kv.kv[:, :, b] = content(h)


def assert_content(store: KVStore, block_ids: list[BlockId], hashes: list[BlockHash]) -> None:
    for b, h in zip(block_ids, hashes):
        assert bool((store.kv.kv[:, :, b] == content(h)).all()), f"block {b} does not hold {h:x}"


def computed(store: KVStore, hashes: list[BlockHash]) -> list[BlockId]:
    """A sequence of `hashes` computed and finished: cached in the pool, no reference held."""
    ids = store.allocate(len(hashes))
    write(store, ids, hashes)
    store.cache(ids, hashes)
    store.free_sequence(ids)
    return ids


def offload_store(num_blocks: int = 4, host_blocks: int = 8) -> KVStore:
    return KVStore(LAYOUT, num_blocks, offload_bytes=host_blocks * LAYOUT.bytes_per_block)


def test_lookup_finds_device_then_host_and_take_onloads_bit_exact() -> None:
    store = offload_store()
    chain = [H(i) for i in range(3)]
    computed(store, chain)
    assert store.lookup(chain + [H(9)]) == Match(tuple(store.lookup(chain).device), 0)
    assert len(store.lookup(chain).device) == 3
    store.free(store.allocate(4))                       # evicts all three into the host tier
    match = store.lookup(chain + [H(9)])
    assert match == Match((), 3) and match.num_blocks == 3
    before = store.usage()
    ids = store.take(chain, match, 4)                   # 3 onloaded + 1 fresh
    assert len(ids) == 4 and len(set(ids)) == 4
    assert_content(store, ids[:3], chain)
    assert store.lookup(chain).device == tuple(ids[:3])     # re-cached on the device
    after = store.usage()
    assert after.num_onloaded_blocks - before.num_onloaded_blocks == 3
    assert after.num_used_blocks == 4
    store.check_integrity([ids])
    store.free_sequence(ids)
    store.check_integrity([])


def test_take_that_does_not_fit_changes_nothing() -> None:
    store = offload_store(num_blocks=4)
    chain = [H(i) for i in range(2)]
    computed(store, chain)
    held = store.allocate(2)                            # the two uncached blocks
    match = store.lookup(chain)
    assert len(match.device) == 2
    usage = store.usage()
    with pytest.raises(OutOfBlocks):
        store.take(chain, match, 3)                     # 2 reused + 1 fresh, but none is free
    assert store.usage() == usage
    store.check_integrity([held])
    ids = store.take(chain, match, 2)
    assert ids == list(match.device)
    assert store.usage().prefix_hit_blocks == 2
    store.check_integrity([held, ids])


def test_read_copies_the_leading_run_from_both_tiers_and_stage_lands_in_host() -> None:
    owner = offload_store(num_blocks=4)
    chain = [H(i) for i in range(6)]
    computed(owner, chain[:3])
    owner.free(owner.allocate(4))                       # chain[:3] to host
    computed(owner, chain[3:5])                         # chain[3:5] on the device
    held = owner.read(chain, CPU)                       # chain[5] is nowhere: the run stops
    assert held.num_blocks == 5 and held.blocks is not None
    for j, h in enumerate(chain[:5]):
        assert bool((held.blocks[:, :, j] == content(h)).all()), j
    assert owner.read([H(99)], CPU) == (0, None)

    puller = KVStore(LAYOUT, 8)
    with pytest.raises(NoHostTier):
        puller.stage(chain[:5], held.blocks)
    tier = puller.ensure_host_tier(6)
    assert puller.ensure_host_tier(99) is tier and puller.host_num_blocks == 6
    assert puller.stage(chain[:5], held.blocks) == 5
    assert puller.stage(chain[:2], held.blocks[:, :, :2]) == 0       # already held: refreshed
    match = puller.lookup(chain)
    assert match == Match((), 5)
    ids = puller.take(chain, match, 6)
    assert_content(puller, ids[:5], chain[:5])
    puller.check_integrity([ids])


def test_read_now_copies_the_device_run_and_drops_blocks_evicted_during_the_copy(monkeypatch) -> None:
    """`read_now` (a peer's read beside a running step) returns what `read` does for blocks
    the device pool holds; a block evicted and overwritten while it was being copied ends the
    run there (its hash no longer maps to that block); a run going on in the host tier, or
    a first block lost, is left to `read` on the engine thread (None)."""
    store = KVStore(LAYOUT, 8)
    chain = [H(i) for i in range(4)]
    ids = computed(store, chain)
    held = store.read_now(chain + [H(99)], CPU)
    assert held is not None and held.num_blocks == 4
    assert torch.equal(held.blocks, store.read(chain, CPU).blocks)
    assert store.read_now([H(99)], CPU) == (0, None)

    gather = store.kv.gather_blocks

    def step_meanwhile(block_ids):                       # the engine thread runs a step mid-copy
        out = gather(block_ids)
        taken = store.allocate(len(store.pool.free_block_ids()))   # evicts every cached block
        write(store, taken, [H(50 + i) for i in range(len(taken))])
        return out
    monkeypatch.setattr(store.kv, "gather_blocks", step_meanwhile)
    assert store.read_now(chain, CPU) is None               # nothing of the copy can be trusted
    monkeypatch.undo()

    store = KVStore(LAYOUT, 8)
    ids = computed(store, chain)
    victim = ids[2]

    def evict_third(block_ids):
        out = store.kv.__class__.gather_blocks(store.kv, block_ids)
        store.pool._drop_hash(store.pool._blocks[victim])   # chain[2]'s block evicted...
        store.kv.kv[:, :, victim] = -1.0                     # ...and written by the step
        return out
    monkeypatch.setattr(store.kv, "gather_blocks", evict_third)
    held = store.read_now(chain, CPU)
    assert held is not None and held.num_blocks == 2
    for j, h in enumerate(chain[:2]):
        assert bool((held.blocks[:, :, j] == content(h)).all())
    monkeypatch.undo()

    owner = offload_store(num_blocks=4)
    computed(owner, chain[:3])
    owner.free(owner.allocate(4))                          # chain[:3] to host
    assert owner.read_now(chain[:3], CPU) is None          # the host tier's run: the engine thread's
    assert owner.read(chain[:3], CPU).num_blocks == 3


def test_staging_tier_takes_no_evictions() -> None:
    store = KVStore(LAYOUT, 4)
    store.ensure_host_tier(4)
    computed(store, [H(0), H(1)])
    store.free(store.allocate(4))
    assert store.lookup([H(0)]) == Match((), 0)
    assert store.usage().num_host_blocks == 0


def test_events_of_both_tiers_come_in_one_ordered_log() -> None:
    store = offload_store(num_blocks=2, host_blocks=4)
    store.set_event_recording(True)
    ids = computed(store, [H(0), H(1)])
    store.free(store.allocate(1))                       # LRU head: H(1)'s block (tail freed first)
    events = store.take_events()
    assert events == [
        TieredEvent(Tier.DEVICE, BlockStored(H(0), None, ids[0])),
        TieredEvent(Tier.DEVICE, BlockStored(H(1), H(0), ids[1])),
        TieredEvent(Tier.HOST, BlockStored(H(1), None, BlockId(0))),    # the tier move: host first
        TieredEvent(Tier.DEVICE, BlockRemoved(H(1), ids[1])),
    ]
    assert store.take_events() == []
    wire = from_tiered_events(events)
    assert [(w.type, w.tier, w.hashes) for w in wire] == [
        (EventType.STORED, Tier.DEVICE, (H(0), H(1))),
        (EventType.STORED, Tier.HOST, (H(1),)),
        (EventType.REMOVED, Tier.DEVICE, (H(1),)),
    ]
    assert store.inventory() == {Tier.DEVICE: [H(0)], Tier.HOST: [H(1)]}


def test_integrity_check_counts_every_reference() -> None:
    store = KVStore(LAYOUT, 4)
    ids = store.allocate(2)
    store.check_integrity([ids])
    with pytest.raises(AssertionError, match="referenced"):
        store.check_integrity([ids[:1]])                # one held block unaccounted for
    store.free(ids)
    with pytest.raises(ValueError, match="offload_bytes needs prefix caching"):
        KVStore(LAYOUT, 4, enable_prefix_caching=False, offload_bytes=LAYOUT.bytes_per_block)


CHAINS = 3          # chain c is H(10c), H(10c + 1), ...: sequences sharing prefixes


class StoreMachine(RuleBasedStateMachine):
    """Sequences admitted, computed, released and squeezed out through one small store with
    a host tier behind it; every reused block must hold its hash's content."""

    def __init__(self) -> None:
        super().__init__()
        self.store = offload_store(num_blocks=8, host_blocks=4)
        self.store.set_event_recording(True)
        self.held: list[tuple[list[BlockId], list[BlockHash]]] = []

    @rule(chain=st.integers(0, CHAINS - 1), length=st.integers(1, 4), extra=st.integers(0, 1))
    def admit(self, chain: int, length: int, extra: int) -> None:
        hashes = [H(10 * chain + i) for i in range(length)]
        match = self.store.lookup(hashes)
        usage = self.store.usage()
        try:
            ids = self.store.take(hashes, match, length + extra)
        except OutOfBlocks:
            assert self.store.usage() == usage
            return
        assert_content(self.store, ids[:match.num_blocks], hashes[:match.num_blocks])
        fresh = ids[match.num_blocks:length]
        write(self.store, fresh, hashes[match.num_blocks:])
        self.store.cache(ids[:length], hashes)
        self.held.append((ids, hashes))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ids, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.store.free_sequence(ids)

    @rule(n=st.integers(1, 8))
    def pressure(self, n: int) -> None:
        """Another sequence's scratch blocks: evicts (and offloads) cached free blocks."""
        if n <= self.store.num_free_blocks:
            self.store.free(self.store.allocate(n))

    @rule(chain=st.integers(0, CHAINS - 1))
    def read(self, chain: int) -> None:
        hashes = [H(10 * chain + i) for i in range(4)]
        held = self.store.read(hashes, CPU)
        assert held.num_blocks == self.store.lookup(hashes).num_blocks
        for j in range(held.num_blocks):
            assert held.blocks is not None and bool((held.blocks[:, :, j] == content(hashes[j])).all())

    @invariant()
    def consistent(self) -> None:
        self.store.check_integrity([ids for ids, _ in self.held])
        for ids, hashes in self.held:              # nothing in use is evicted
            assert_content(self.store, ids[:len(hashes)], hashes)
        self.store.take_events()


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_store_state_machine = StoreMachine.TestCase
