"""KVStore over three tiers — device pool, host tier, disk tier — as a hypothesis state machine.

Every block's content is a function of its hash (so a block that comes back from any tier
with the wrong bytes shows). Sequences are admitted (through the disk read-ahead when their
prefix goes on on disk), computed, released and squeezed out of a tiny device pool and a
tinier host tier into the disk tier; the store may also be rebuilt on the same directory (a
restart). After every step: integrity of every tier, nothing in use evicted, every held block
holds its content; after a flush, the disk tier's events add up to what it holds.
"""
from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.disk_record import DiskSpec, slot_bytes
from kvstore.errors import OutOfBlocks
from kvstore.events import Tier
from kvstore.keys import BlockHash
from kvstore.layout import KVLayout
from kvstore.pool import AllBlocksCleared, BlockId, BlockRemoved, BlockStored
from kvstore.store import KVStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, kv_cache_dtype="fp32")
CHAINS = 3                                         # chain c: H(10c), H(10c + 1), ...
ROOTS = (None, BlockHash(0xA1), BlockHash(0xB2))   # chain c's salt root
FP = b"statemachine-fp!"


def H(i: int) -> BlockHash:
    return BlockHash(0x7000 + i)


def content(h: BlockHash) -> float:
    return float(h % 251)


def _store(path: str) -> KVStore:
    return KVStore(LAYOUT, 8, offload_bytes=2 * LAYOUT.bytes_per_block,
                   disk=DiskSpec(path, 12 * slot_bytes(LAYOUT.bytes_per_block), FP))


class TiersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvmesh-tiers-")
        self.store = _store(self.dir)
        self.store.set_event_recording(True)
        self.held: list[tuple[list[BlockId], list[BlockHash]]] = []
        self.on_disk: set[BlockHash] = set()       # what the disk tier's events add up to

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _events(self) -> None:
        for tiered in self.store.take_events():
            if tiered.tier is not Tier.DISK:
                continue
            e = tiered.event
            if isinstance(e, BlockStored):
                self.on_disk.add(e.block_hash)
            elif isinstance(e, BlockRemoved):
                self.on_disk.discard(e.block_hash)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.on_disk.clear()

    @rule(chain=st.integers(0, CHAINS - 1), length=st.integers(1, 4), extra=st.integers(0, 1))
    def admit(self, chain: int, length: int, extra: int) -> None:
        hashes = [H(10 * chain + i) for i in range(length)]
        root = ROOTS[chain]
        self.store.disk.flush()                                 # written behind: landed before the lookup
        match = self.store.lookup(hashes, root)
        if match.num_disk and self.store.read_ahead(hashes[match.num_blocks:match.num_blocks + match.num_disk], root):
            while self.store.wait_for_disk(5.0) and not self.store.poll_disk():
                if not self.store.disk.busy():
                    break
            match = self.store.lookup(hashes, root)
        usage = self.store.usage()
        try:
            ids = self.store.take(hashes, match, length + extra)
        except OutOfBlocks:
            assert self.store.usage() == usage
            return
        for b, h in zip(ids[:match.num_blocks], hashes):       # from any tier: its own content
            assert bool((self.store.kv.kv[:, :, b] == content(h)).all()), f"block {b} does not hold {h:x}"
        for b, h in zip(ids[match.num_blocks:length], hashes[match.num_blocks:]):
            self.store.kv.kv[:, :, b] = content(h)
        self.store.cache(ids[:length], hashes, salt_root=root)
        self.held.append((ids, hashes))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ids, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.store.free_sequence(ids)

    @rule(n=st.integers(1, 8))
    def pressure(self, n: int) -> None:
        """Scratch blocks: evict cached free blocks to host, and host blocks to disk."""
        if n <= self.store.num_free_blocks:
            self.store.free(self.store.allocate(n))

    @precondition(lambda self: not self.held)
    @rule(chain=st.integers(0, CHAINS - 1), rounds=st.integers(1, 3))
    def round_trip(self, chain: int, rounds: int) -> None:
        """A chain computed, released, pushed down by `rounds` full-pool allocations, asked again."""
        self.admit(chain, 4, 0)
        while self.held:
            self.store.free_sequence(self.held.pop()[0])
        for _ in range(rounds):
            self.pressure(self.store.num_free_blocks)
        self.admit(chain, 4, 0)

    @rule(chain=st.integers(0, CHAINS - 1))
    def wrong_salt_finds_nothing_on_disk(self, chain: int) -> None:
        hashes = [H(10 * chain + i) for i in range(4)]
        wrong = ROOTS[(chain + 1) % CHAINS]
        assert self.store.disk.match_prefix(wrong, hashes) == 0

    @rule()
    def flush(self) -> None:
        self.store.disk.flush()
        self._events()
        assert self.on_disk == set(self.store.disk.cached_hashes())

    @precondition(lambda self: not self.held)
    @rule()
    def restart(self) -> None:
        """A new store on the same directory: device and host are empty, the disk reopens."""
        self.store.disk.flush()
        self._events()
        before = set(self.store.disk.cached_hashes())
        self.store.close()
        self.store = _store(self.dir)
        self.store.set_event_recording(True)
        assert set(self.store.disk.cached_hashes()) == before
        assert set(self.store.inventory()[Tier.DISK]) == before
        self.on_disk = before

    @invariant()
    def consistent(self) -> None:
        self.store.check_integrity([ids for ids, _ in self.held])
        for ids, hashes in self.held:              # nothing in use is evicted
            for b, h in zip(ids, hashes):
                assert bool((self.store.kv.kv[:, :, b] == content(h)).all())
        assert self.store.disk.enabled and self.store.disk.stats().dropped_checksum == 0


TiersMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_tiers_state_machine = TiersMachine.TestCase


def test_admission_reads_a_disk_prefix_back_through_the_host_tier(tmp_path) -> None:
    store = _store(str(tmp_path))
    hashes = [H(i) for i in range(2)]
    ids = store.allocate(2)
    for b, h in zip(ids, hashes):
        store.kv.kv[:, :, b] = content(h)
    store.cache(ids, hashes)
    store.free_sequence(ids)
    for i in range(3):                     # other cached blocks push these through host (2 slots) to disk
        more = store.allocate(1)
        store.kv.kv[:, :, more[0]] = 0.0
        store.cache(more, [H(100 + i)])
        store.free(more)
        store.free(store.allocate(8))
    store.disk.flush()
    match = store.lookup(hashes)
    assert match.num_blocks == 0 and match.num_disk == 2
    assert store.read_ahead(hashes)
    while not store.poll_disk():
        store.wait_for_disk(1.0)
    match = store.lookup(hashes)
    assert match.num_host == 2 and match.num_disk == 0
    got = store.take(hashes, match, 2)
    assert all(bool((store.kv.kv[:, :, b] == content(h)).all()) for b, h in zip(got, hashes))
    assert store.usage().num_disk_staged_blocks == 2
    store.close()
