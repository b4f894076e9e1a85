"""BlockIndex: examples, then a hypothesis state machine against a dict model (for both storages)."""
from __future__ import annotations

import gc
import random
import subprocess
import sys

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmesh.bench.scale_baseline import TrackedCompactIndex
from kvstore.events import EventType, Tier, WireEvent, WorkerId, inventory_events
from kvstore.keys import BlockHash
from router.index.blocks import BlockIndex, IndexStats
from router.index.compact import CompactBlockIndex

H = [BlockHash(0x1000 + i) for i in range(8)]
A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def stored(*hashes: BlockHash, tier: Tier = Tier.DEVICE) -> WireEvent:
    return WireEvent(EventType.STORED, hashes, None, tier)


def removed(*hashes: BlockHash, tier: Tier = Tier.DEVICE) -> WireEvent:
    return WireEvent(EventType.REMOVED, hashes, None, tier)


def test_match_prefix_stops_at_first_missing_block() -> None:
    index = BlockIndex()
    index.apply(A, stored(H[0], H[1], H[2], H[3]))
    index.apply(B, stored(H[0], H[2], H[3]))  # lacks H[1]
    index.apply(C, stored(H[1], H[2]))        # lacks H[0]
    assert index.match_prefix(H[:4]) == {A: 4, B: 1, C: 0}
    assert index.match_prefix(H[:4], [B, WorkerId("z")]) == {B: 1, "z": 0}
    assert index.match_prefix([]) == {A: 0, B: 0, C: 0}
    assert index.match_prefix([H[7], H[0]]) == {A: 0, B: 0, C: 0}
    assert index.stats() == IndexStats(num_blocks=4, num_entries=9, num_workers=3, events_applied=3)
    index.check_integrity()


def test_tiers_are_tracked_per_worker() -> None:
    index = BlockIndex()
    index.apply(A, stored(H[0], H[1]))
    index.apply(A, stored(H[0], tier=Tier.HOST))  # offloaded, device copy still there
    index.apply(A, removed(H[0]))                 # device copy evicted
    assert index.locate(H[0]) == {A: frozenset({Tier.HOST})}
    assert index.match_prefix(H[:2]) == {A: 2}
    index.apply(A, WireEvent(EventType.CLEARED, tier=Tier.HOST))
    assert index.holdings(A) == {H[1]: frozenset({Tier.DEVICE})}
    index.apply(A, removed(H[5]))  # unknown: ignored
    index.check_integrity()


@pytest.mark.parametrize("make", [BlockIndex, CompactBlockIndex])
def test_disk_only_counts_the_leading_blocks_held_on_disk_alone(make: type[BlockIndex]) -> None:
    index = make()
    index.apply(A, stored(H[0], H[1]))
    index.apply(A, stored(H[2], H[3], tier=Tier.DISK))
    index.apply(B, stored(H[0], H[1], H[2], tier=Tier.DISK))
    index.apply(B, stored(H[0], tier=Tier.HOST))              # H[0] on host and disk: not disk-only
    index.apply(C, stored(H[0]))
    counts = index.match_leading(H[:4])
    assert counts == {A: 4, B: 3, C: 1}
    assert index.disk_only(H[:4], counts) == {A: 2, B: 2}
    assert index.disk_only(H[:4], {A: 3, B: 1}) == {A: 1}      # only the counted leading blocks
    index.apply(A, removed(H[3], tier=Tier.DISK))
    index.apply(A, stored(H[2], tier=Tier.HOST))              # read back into host: no longer disk-only
    assert index.disk_only(H[:4], index.match_leading(H[:4])) == {B: 2}


def test_inventory_replaces_and_workers_come_and_go() -> None:
    index = BlockIndex()
    index.apply(A, stored(*H[:3]))
    index.apply(B, stored(*H[:3]))
    for event in inventory_events({Tier.DISK: [H[5]], Tier.DEVICE: [H[0]]}):
        index.apply(A, event)
    assert index.holdings(A) == {H[0]: frozenset({Tier.DEVICE}), H[5]: frozenset({Tier.DISK})}
    index.clear_worker(B)
    assert index.workers() == [A, B] and index.holdings(B) == {}
    index.remove_worker(A)
    assert index.workers() == [B] and index.stats().num_blocks == 0
    index.remove_worker(WorkerId("never-seen"))
    index.check_integrity()


def test_shared_blocks_count_what_two_requests_asked_for_and_learn_the_rest_by_depth() -> None:
    """A block two requests' prompts held is shared wherever it is held; a block one asked
    for counts at the rate blocks of its depth were asked again ((again + 1) / (once + 2));
    the distinct count takes each block once however many workers hold it."""
    index = BlockIndex()
    prefix, q1, q2 = H[:2], H[2], H[3]          # a two-block prefix, two one-block questions
    index.add_pending("r1", A, (*prefix, q1), expires_at=100.0)
    index.apply(A, stored(*prefix, q1))
    # depths 0, 1, 2 each asked once, never again: rate 1/3 each
    assert index.shared_blocks(A) == pytest.approx(3 * 1 / 3) and index.shared_blocks(B) == 0
    index.add_pending("r2", A, (*prefix, q2), expires_at=100.0)
    index.apply(A, stored(q2))
    # the prefix is shared now (2 blocks); depths 0 and 1 were asked again; q1 and q2 sit at
    # depth 2, asked once twice and never again: (0 + 1) / (2 + 2) each
    assert index.shared_blocks(A) == pytest.approx(2 + 2 * 1 / 4)
    index.apply(B, stored(*prefix))            # a copy on B (a peer fetch)
    assert index.shared_blocks(B) == 2
    assert index.distinct_shared_blocks() == pytest.approx(2 + 2 * 1 / 4)
    index.add_pending("r2", A, (*prefix, q2), expires_at=100.0)   # a retry of r2 counts no new ask
    assert index.shared_blocks(A) == pytest.approx(2 + 2 * 1 / 4)
    index.apply(A, removed(*prefix, q1))
    assert index.shared_blocks(A) == pytest.approx(1 / 4) and index.shared_blocks(B) == 2
    index.remove_worker(B)
    assert index.distinct_shared_blocks() == pytest.approx(1 / 4)
    index.check_integrity()
    index.expire_pending(200.0)
    index.apply(A, removed(q2))
    assert index.shared_blocks(A) == 0 == index.distinct_shared_blocks()
    index.check_integrity()


def test_shared_evidence_halves_with_each_half_life_of_traffic_that_passes_it_by() -> None:
    """The traffic clock reads prompt blocks routed over the pools' capacity; a block's part in
    `shared_blocks` halves per `ask_half_life` of it since its last ask, an ask renews it, and
    with no capacity set the clock stands (nothing fades)."""
    index = BlockIndex(ask_half_life=1.0)
    index.set_capacity(10)
    prefix = H[:2]
    index.add_pending("r1", B, (*prefix, H[2]), expires_at=100.0)      # clock 0.3
    index.add_pending("r2", B, (*prefix, H[3]), expires_at=100.0)      # clock 0.6
    index.apply(A, stored(*prefix))            # A holds the prefix, asked for twice at 0.6
    assert index.traffic_clock == pytest.approx(0.6)
    assert index.shared_blocks(A) == pytest.approx(2.0)
    for i in range(10):                        # one pool-full of other traffic: one half-life
        index.add_pending(f"other{i}", B, (BlockHash(0x9000 + i),), expires_at=100.0)
    assert index.traffic_clock == pytest.approx(1.6)
    assert index.shared_blocks(A) == pytest.approx(1.0)
    assert index.distinct_shared_blocks() == pytest.approx(1.0)
    for i in range(20):
        index.add_pending(f"more{i}", B, (BlockHash(0xA000 + i),), expires_at=100.0)
    assert index.shared_blocks(A) == pytest.approx(0.25)           # cold: room
    index.add_pending("r3", B, (*prefix, H[4]), expires_at=100.0)      # asked again: renewed
    assert index.shared_blocks(A) == pytest.approx(2.0)
    index.set_capacity(0)                      # no capacity known: the clock stands
    for i in range(20):
        index.add_pending(f"still{i}", B, (BlockHash(0xB000 + i),), expires_at=100.0)
    assert index.shared_blocks(A) == pytest.approx(2.0)
    index.check_integrity()


def test_evidence_weights_are_rebased_long_before_they_overflow() -> None:
    """Thousands of half-lives of traffic: the weights' base moves (the tallies are recounted)
    and the values stay exact."""
    index = BlockIndex(ask_half_life=0.1)
    index.set_capacity(1)
    for i in range(300):                       # 5 blocks per request: 50 half-lives each
        hashes = (H[0], H[1], BlockHash(0xC000 + i), BlockHash(0xD000 + i), BlockHash(0xE000 + i))
        index.add_pending(f"r{i}", A, hashes, expires_at=float(i))
        index.apply(A, stored(*hashes))
        index.expire_pending(float(i))
        if i % 2 == 0:
            index.apply(A, removed(*hashes[2:]))
    # the prefix, renewed by every request; the last request's three blocks, asked once at
    # depths where 300 first asks had no second: (0 + 1) / (300 + 2); the older ones faded
    assert index.shared_blocks(A) == pytest.approx(2.0 + 3 / 302, rel=1e-6)
    index.check_integrity()


@pytest.mark.multiproc
def test_router_index_imports_no_torch() -> None:
    code = "import sys, router.index.blocks, kvstore.metadata.streams; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


workers = st.sampled_from([A, B, C])
tiers = st.sampled_from(list(Tier))
hash_lists = st.lists(st.sampled_from(H), max_size=5)


class IndexMachine(RuleBasedStateMachine):
    """The model: worker → block → set of tiers, plus the set of known workers."""

    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(ask_half_life=0.01)   # with a capacity of 1, asks move the weights' base
        self.model: dict[WorkerId, dict[BlockHash, set[Tier]]] = {}

    def _held(self, w: WorkerId) -> dict[BlockHash, set[Tier]]:
        return self.model.setdefault(w, {})

    def _drop(self, w: WorkerId, h: BlockHash, tier: Tier) -> None:
        held = self._held(w)
        held.get(h, set()).discard(tier)
        if not held.get(h, True):
            del held[h]

    @rule(w=workers, hashes=hash_lists, tier=tiers)
    def store(self, w: WorkerId, hashes: list[BlockHash], tier: Tier) -> None:
        self.index.apply(w, stored(*hashes, tier=tier))
        self._held(w)
        for h in hashes:
            self._held(w).setdefault(h, set()).add(tier)

    @rule(w=workers, hashes=hash_lists, tier=tiers)
    def remove(self, w: WorkerId, hashes: list[BlockHash], tier: Tier) -> None:
        self.index.apply(w, removed(*hashes, tier=tier))
        self._held(w)  # any event makes its worker known
        for h in hashes:
            self._drop(w, h, tier)

    @rule(w=workers, tier=tiers)
    def clear_tier(self, w: WorkerId, tier: Tier) -> None:
        self.index.apply(w, WireEvent(EventType.CLEARED, tier=tier))
        for h in list(self._held(w)):
            self._drop(w, h, tier)

    @rule(w=workers, by_tier=st.dictionaries(tiers, hash_lists, max_size=3))
    def inventory(self, w: WorkerId, by_tier: dict[Tier, list[BlockHash]]) -> None:
        for event in inventory_events(by_tier):
            self.index.apply(w, event)
        self.model[w] = {}
        for tier, hashes in by_tier.items():
            for h in hashes:
                self.model[w].setdefault(h, set()).add(tier)

    @rule(w=workers)
    def clear_worker(self, w: WorkerId) -> None:
        self.index.clear_worker(w)
        self.model[w] = {}

    @rule(w=workers)
    def remove_worker(self, w: WorkerId) -> None:
        self.index.remove_worker(w)
        self.model.pop(w, None)

    @rule(rid=st.integers(0, 5), w=workers, hashes=hash_lists)
    def ask(self, rid: int, w: WorkerId, hashes: list[BlockHash]) -> None:
        """A request routed (its asks counted, its blocks pending; pending blocks are not
        holdings, so the model is untouched); shared counts are checked by check_integrity."""
        self.index.add_pending(f"r{rid}", w, hashes, expires_at=float(rid))
        self._held(w)

    @rule(capacity=st.sampled_from([0, 1, 64]))
    def set_capacity(self, capacity: int) -> None:
        self.index.set_capacity(capacity)

    @rule(w=workers, hashes=hash_lists)
    def forget(self, w: WorkerId, hashes: list[BlockHash]) -> None:
        self.index.forget(w, hashes)         # an unknown worker stays unknown
        for h in hashes:
            self.model.get(w, {}).pop(h, None)

    @rule(rid=st.integers(0, 5))
    def drop_request(self, rid: int) -> None:
        self.index.drop_pending(f"r{rid}")

    @rule(now=st.integers(0, 6))
    def expire(self, now: int) -> None:
        self.index.expire_pending(float(now))

    @rule(query=st.lists(st.sampled_from(H), max_size=6), some=st.lists(workers, max_size=3))
    def match(self, query: list[BlockHash], some: list[WorkerId]) -> None:
        for subset in (None, some):
            expected = {}
            for w in (self.model if subset is None else subset):
                held = self.model.get(w, {})
                n = 0
                while n < len(query) and query[n] in held:
                    n += 1
                expected[w] = n
            assert self.index.match_prefix(query, subset, pending=False) == expected

    @invariant()
    def agrees_with_model(self) -> None:
        self.index.check_integrity()
        assert self.index.workers() == sorted(self.model)
        for w, held in self.model.items():
            assert self.index.holdings(w) == {h: frozenset(t) for h, t in held.items()}
        for h in H:
            assert self.index.locate(h) == {w: frozenset(held[h]) for w, held in self.model.items()
                                            if h in held}
        # the requests computing the blocks, per worker: as the pending map names them (sparse)
        computing: dict[WorkerId, set[str]] = {}
        for h in H:
            for w, rids in self.index._pending.by_block.get(h, {}).items():
                computing.setdefault(w, set()).update(rids)
        assert self.index.computing_any(H) == computing
        assert self.index.computing_any(H[:2]) == {
            w: set().union(*(self.index._pending.by_block.get(h, {}).get(w, set()) for h in H[:2]))
            for w in {w for h in H[:2] for w in self.index._pending.by_block.get(h, {})}}


IndexMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)
TestIndexMachine = IndexMachine.TestCase


class CompactIndexMachine(IndexMachine):
    """The same model against `CompactBlockIndex` (the registry's index): one-holder blocks packed
    into ints, shared ones moving to the side map and back as holders come and go — and its
    large containers never tracked by the garbage collector."""

    def __init__(self) -> None:
        super().__init__()
        self.index = CompactBlockIndex(ask_half_life=0.01)

    @invariant()
    def out_of_the_collectors_sight(self) -> None:
        index = self.index
        assert not any(gc.is_tracked(m) for m in (index._blocks, index._asked, index._asked_at))
        assert not any(gc.is_tracked(held) for held in index._by_worker.values())


CompactIndexMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)
TestCompactIndexMachine = CompactIndexMachine.TestCase


def test_a_held_blocks_evidence_survives_a_far_newer_ask_being_dropped() -> None:
    """Weights one pool-full apart at half-life 0.01 differ by 2^100: the running sums keep both
    (the base moves before they span more than float64 holds), so dropping the newer block
    leaves the older one's part, as a recount from the blocks says."""
    index = BlockIndex(ask_half_life=0.01)
    a = WorkerId("a")
    for event in inventory_events({Tier.DEVICE: [BlockHash(4097)], Tier.HOST: [BlockHash(4096)]}):
        index.apply(a, event)
    index.set_capacity(1)
    index.add_pending("r0", a, [BlockHash(4096)], expires_at=0.0)
    index.add_pending("r1", a, [BlockHash(4097)], expires_at=1.0)
    index.apply(a, WireEvent(EventType.CLEARED, tier=Tier.DEVICE))
    index.check_integrity()


class TrackedCompactIndexMachine(IndexMachine):
    """The same model against `kvmesh bench scale`'s `compact-tracked` baseline (the compact
    storage as it was): a baseline that kept the contract."""

    def __init__(self) -> None:
        super().__init__()
        self.index = TrackedCompactIndex(ask_half_life=0.01)


TrackedCompactIndexMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestTrackedCompactIndexMachine = TrackedCompactIndexMachine.TestCase


def test_a_full_collection_does_not_walk_the_compact_index() -> None:
    """20,000 (block, worker) entries over 20 workers, shared prefixes among them: what a full
    collection traverses from the index is its few small maps, not one object per entry (the
    previous storage, sets and dict values, gave the collector every entry)."""
    rng = random.Random(0)
    prefix = [BlockHash(rng.getrandbits(128)) for _ in range(32)]
    indexes = (CompactBlockIndex(), TrackedCompactIndex())
    for index in indexes:
        rng.seed(1)
        for w in range(20):
            own = [BlockHash(rng.getrandbits(128)) for _ in range(1000 - len(prefix))]
            index.add(WorkerId(f"w{w}"), [*(prefix if w % 2 else []), *own], Tier.DEVICE)
        index.add_pending("r", WorkerId("w0"), prefix, expires_at=1.0)
        index.check_integrity()

    def traversed(index: BlockIndex) -> int:
        """References the collector visits in the index's tracked containers (classes not followed)."""
        seen: set[int] = set()
        stack: list[object] = [vars(index)]
        n = 0
        while stack:
            obj = stack.pop()
            if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, type):
                continue
            seen.add(id(obj))
            refs = gc.get_referents(obj)
            n += len(refs)
            stack.extend(refs)
        return n

    new, old = (traversed(index) for index in indexes)
    assert new < 2_000 and old > 20_000, (new, old)
