"""BlockPool against a small list/dict model of the same pool (hypothesis state machine).

The model keeps the free queue as two Python lists (probation, then protected: blocks a later
request reused), ref counts, block hashes, the reused set and each block's free time (in blocks
allocated: a protected block freed `window` allocations ago competes with probation by age;
the window moves by STEP on each hash cached again after its eviction, kvstore/fade.py) as
dicts/sets. After every step: `check_integrity()` holds, the pool's state,
events and counters equal the model's, and no referenced block lost its cached hash.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import OutOfBlocks
from kvstore.keys import BlockHash, block_hashes
from kvstore.pool import AllBlocksCleared, BlockId, BlockPool, BlockRemoved, BlockStored, KVEvent, PoolStats

NUM_BLOCKS = 8
MAX_PROTECTED = 4    # BlockPool(NUM_BLOCKS, protected_frac=0.5)
STALE_AFTER = NUM_BLOCKS // 2   # protect_turnovers=0.5: fades often within a run
FADE_STEPS = 8.0     # BlockPool(fade_steps=8): each mistake moves the window by 1 allocation
STEP = NUM_BLOCKS / FADE_STEPS
WINDOW = (min(STALE_AFTER, NUM_BLOCKS / 8), max(STALE_AFTER, 4 * NUM_BLOCKS))   # kvstore/fade.py's bounds
BS = 2
SALT = b"statemachine"
# a 2-letter alphabet and 2-token blocks: only 4 distinct first blocks, so prefixes collide
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=12)


@dataclass
class Model:
    probation: list[BlockId] = field(default_factory=lambda: [BlockId(i) for i in range(NUM_BLOCKS)])
    protected: list[BlockId] = field(default_factory=list)
    reused: set[BlockId] = field(default_factory=set)
    ref: dict[BlockId, int] = field(default_factory=lambda: {BlockId(i): 0
                                                             for i in range(NUM_BLOCKS)})
    hash_of: dict[BlockId, BlockHash] = field(default_factory=dict)
    block_of: dict[BlockHash, BlockId] = field(default_factory=dict)
    events: list[KVEvent] = field(default_factory=list)
    evicted: list[tuple[BlockId, BlockHash]] = field(default_factory=list)
    stats: PoolStats = PoolStats(0, 0, 0, 0, 0)
    clock: int = 0
    freed_at: dict[BlockId, int] = field(default_factory=dict)
    window: float = float(STALE_AFTER)
    ghosts: dict[bool, list[BlockHash]] = field(default_factory=lambda: {False: [], True: []})

    @property
    def free(self) -> list[BlockId]:
        """Eviction order: probation first, but a stale protected head freed before the probation
        head (that caches something) goes before it."""
        probation, protected, out = list(self.probation), list(self.protected), []
        while probation or protected:
            p = probation[0] if probation else None
            q = protected[0] if protected else None
            when = self.freed_at.get
            if q is not None and (p is None or (when(q, 0) <= self.clock - int(self.window) and p in self.hash_of
                                                and when(q, 0) < when(p, 0))):
                out.append(protected.pop(0))
            else:
                out.append(probation.pop(0))
        return out

    def allocate(self, n: int) -> list[BlockId] | None:
        if n > len(self.free):
            return None
        taken = self.free[:n]
        was_protected = {b for b in taken if b in self.protected}
        self.probation = [b for b in self.probation if b not in taken]
        self.protected = [b for b in self.protected if b not in taken]
        for b in taken:
            if b in self.hash_of:
                self.reused.discard(b)
                h = self.hash_of.pop(b)
                del self.block_of[h]
                ghosts = self.ghosts[b in was_protected]
                if h in ghosts:
                    ghosts.remove(h)
                ghosts.append(h)
                del ghosts[:-NUM_BLOCKS]
                self.evicted.append((b, h))
                self.events.append(BlockRemoved(h, b))
                self.stats = self.stats._replace(evictions=self.stats.evictions + 1)
            self.ref[b] = 1
        self.clock += n
        return taken

    def free_sequence(self, blocks: list[BlockId]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.freed_at[b] = self.clock
                if b in self.reused:
                    self.protected.append(b)
                    if len(self.protected) > MAX_PROTECTED:
                        self.probation.append(self.protected.pop(0))
                else:
                    self.probation.append(b)

    def touch(self, blocks: list[BlockId]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                (self.protected if b in self.protected else self.probation).remove(b)
            self.ref[b] += 1
            if b in self.hash_of:
                self.reused.add(b)

    def find(self, hashes: list[BlockHash]) -> list[BlockId]:
        found: list[BlockId] = []
        for h in hashes:
            if h not in self.block_of:
                break
            found.append(self.block_of[h])
        q, hits, qb, hb, ev = self.stats
        self.stats = PoolStats(q + 1, hits + bool(found), qb + len(hashes), hb + len(found), ev)
        return found

    def cache(self, blocks: list[BlockId], hashes: list[BlockHash]) -> None:
        parent = None
        for b, h in zip(blocks, hashes):
            if b not in self.hash_of and h not in self.block_of:
                self.hash_of[b] = h
                self.block_of[h] = b
                for protected, sign in ((False, -1), (True, 1)):
                    if h in self.ghosts[protected]:
                        self.ghosts[protected].remove(h)
                        self.window = min(WINDOW[1], max(WINDOW[0], self.window + sign * STEP))
                        self.reused.add(b)
                        break
                self.events.append(BlockStored(h, parent, b))
            parent = h

    def reset(self) -> bool:
        if any(self.ref.values()):
            return False
        self.probation += self.protected
        self.protected = []
        self.reused.clear()
        self.ghosts = {False: [], True: []}
        self.hash_of.clear()
        self.block_of.clear()
        self.events.append(AllBlocksCleared())
        return True


@dataclass
class Seq:
    blocks: list[BlockId]
    hashes: list[BlockHash]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.evicted: list[tuple[BlockId, BlockHash]] = []
        self.pool = BlockPool(NUM_BLOCKS, on_evict=lambda bs, hs: self.evicted.extend(zip(bs, hs)),
                              protected_frac=MAX_PROTECTED / NUM_BLOCKS, protect_turnovers=STALE_AFTER / NUM_BLOCKS,
                              fade_steps=FADE_STEPS)
        self.seqs: list[Seq] = []
        self.asked: list[list[int]] = []     # every prompt so far: asking again re-caches evicted hashes
        self.pinned: dict[BlockId, BlockHash] = {}

    @precondition(lambda self: self.asked)
    @rule(data=st.data())
    def ask_again(self, data: st.DataObject) -> None:
        """An earlier prompt again, then cached in full: its evicted blocks come back (the fade's
        ghosts, kvstore/fade.py, move the window)."""
        self.new_request(data.draw(st.sampled_from(self.asked)))
        if self.seqs and self.seqs[-1].hashes:
            seq = self.seqs[-1]
            self.pool.cache_full_blocks(seq.blocks, seq.hashes)
            self.model.cache(seq.blocks, seq.hashes)

    @rule(tokens=TOKENS)
    def new_request(self, tokens: list[int]) -> None:
        """find → touch the hit prefix → allocate the rest (undo the touch if out of blocks)."""
        self.asked.append(tokens)
        hashes = block_hashes(tokens, BS, SALT)
        prefix = self.pool.find_longest_prefix(hashes)
        assert prefix == self.model.find(hashes)
        self.pool.touch(prefix)
        self.model.touch(prefix)
        need = -(-len(tokens) // BS) - len(prefix)
        expected = self.model.allocate(need)
        if expected is None:
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(need)
            self.pool.free_sequence(prefix)
            self.model.free_sequence(prefix)
            return
        assert self.pool.allocate(need) == expected  # exact ids, in the model's LRU order
        self.seqs.append(Seq(prefix + expected, hashes))

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        expected = self.model.allocate(n)
        if expected is None:
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
            return
        assert self.pool.allocate(n) == expected
        self.seqs.append(Seq(expected, []))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        num = data.draw(st.integers(0, len(seq.hashes)))  # the blocks filled so far
        self.pool.cache_full_blocks(seq.blocks, seq.hashes[:num])
        self.model.cache(seq.blocks, seq.hashes[:num])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.pool.free_sequence(seq.blocks)
        self.model.free_sequence(seq.blocks)

    @rule(tokens=TOKENS)
    def find(self, tokens: list[int]) -> None:
        hashes = block_hashes(tokens, BS, SALT)
        assert self.pool.find_longest_prefix(hashes) == self.model.find(hashes)

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity()
        m = self.model
        assert self.pool.free_block_ids() == m.free
        for b in range(NUM_BLOCKS):
            info = self.pool.block_info(BlockId(b))
            assert (info.ref_cnt, info.block_hash) == (m.ref[BlockId(b)], m.hash_of.get(BlockId(b)))
        assert self.pool.num_cached_blocks == len(m.block_of)
        assert self.pool.num_free_blocks == len(m.free)
        assert self.pool.num_protected_blocks == len(m.protected)
        assert self.pool.num_reused_blocks == len(m.reused)
        assert self.pool.protect_window == m.window
        assert self.pool.stats() == m.stats
        assert self.pool.take_events() == m.events
        m.events.clear()
        assert self.evicted == m.evicted

    @invariant()
    def referenced_blocks_keep_their_hash(self) -> None:
        for b, h in self.pinned.items():
            if self.pool.block_info(b).ref_cnt > 0:
                assert self.pool.get_cached_block(h) == b, f"in-use block {b} lost its hash"
        self.pinned = {BlockId(b): h for b, h in self.model.hash_of.items()
                       if self.model.ref[BlockId(b)] > 0}


PoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPoolMachine = PoolMachine.TestCase
