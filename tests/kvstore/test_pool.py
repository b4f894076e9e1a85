"""BlockPool scenarios that pin exact block ids and eviction order (vLLM v1 style)."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import KVStoreError, OutOfBlocks
from kvstore.keys import BlockHash, HashSalt, block_hashes
from kvstore.pool import AllBlocksCleared, BlockId, BlockPool, BlockRemoved, BlockStored, PoolStats

BS = 4
SALT = HashSalt("test-model", "test-tok", "fp16", BS).digest()
PROMPT_A = list(range(1, 15))                 # 14 tokens: 3 full blocks + 2 tokens
PROMPT_B = PROMPT_A[:12] + [90, 91, 92, 93]   # A's 3 full blocks + 1 full block of its own


def ids(*xs: int) -> list[BlockId]:
    return [BlockId(x) for x in xs]


def test_fresh_pool() -> None:
    pool = BlockPool(10)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (10, 10, 0)
    assert pool.num_cached_blocks == 0 and pool.usage == 0.0
    assert pool.free_block_ids() == list(range(10))
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.usage == pytest.approx(0.3)
    pool.check_integrity()


@pytest.mark.parametrize("num_blocks", [0, -1, True])
def test_num_blocks_validated(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_shared_prefix_then_eviction_order() -> None:
    pool = BlockPool(10)
    h_a = block_hashes(PROMPT_A, BS, SALT)
    h_b = block_hashes(PROMPT_B, BS, SALT)
    assert len(h_a) == 3 and h_b[:3] == h_a and len(h_b) == 4

    # request A: 4 blocks, the first 3 full
    blocks_a = pool.allocate(4)
    assert blocks_a == [0, 1, 2, 3]
    pool.cache_full_blocks(blocks_a, h_a)
    assert pool.take_events() == [BlockStored(h_a[0], None, BlockId(0)),
                                  BlockStored(h_a[1], h_a[0], BlockId(1)),
                                  BlockStored(h_a[2], h_a[1], BlockId(2))]

    # request B: reuses A's 3 cached blocks, allocates 1 more
    prefix = pool.find_longest_prefix(h_b)
    assert prefix == [0, 1, 2]
    pool.touch(prefix)
    blocks_b = prefix + pool.allocate(1)
    assert blocks_b == [0, 1, 2, 4]
    assert [pool.ref_cnt(BlockId(b)) for b in range(5)] == [2, 2, 2, 1, 1]
    pool.cache_full_blocks(blocks_b, h_b)
    assert pool.take_events() == [BlockStored(h_b[3], h_a[2], BlockId(4))]
    assert pool.num_cached_blocks == 4
    pool.check_integrity()

    # A finishes: only its private tail block 3 becomes free
    pool.free_sequence(blocks_a)
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 3]
    # B finishes: tail first
    pool.free_sequence(blocks_b)
    assert pool.free_block_ids() == [5, 6, 7, 8, 9, 3, 4, 2, 1, 0]
    assert pool.num_cached_blocks == 4 and pool.num_used_blocks == 0
    pool.check_integrity()

    # C takes 8: never-cached blocks first, then the tail of the shared prefix
    assert pool.allocate(8) == [5, 6, 7, 8, 9, 3, 4, 2]
    assert pool.take_events() == [BlockRemoved(h_b[3], BlockId(4)),
                                  BlockRemoved(h_a[2], BlockId(2))]
    assert pool.free_block_ids() == [1, 0]
    assert pool.find_longest_prefix(h_b) == [0, 1]
    assert pool.stats() == PoolStats(queries=2, hits=2, query_blocks=8, hit_blocks=5,
                                     evictions=2)

    # D reuses the 2 surviving blocks: the free queue empties from the middle out
    pool.touch(ids(0, 1))
    assert pool.free_block_ids() == [] and pool.usage == 1.0
    pool.check_integrity()


def test_out_of_blocks_changes_nothing() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, block_hashes(list(range(12)), BS, SALT))
    pool.free_sequence(blocks)
    pool.take_events()
    before = (pool.free_block_ids(), [pool.block_info(BlockId(b)) for b in range(6)])
    with pytest.raises(OutOfBlocks, match="requested 7 blocks but only 6 are free") as err:
        pool.allocate(7)
    assert issubclass(OutOfBlocks, KVStoreError)
    assert (err.value.num_requested, err.value.num_free) == (7, 6)
    assert pickle.loads(pickle.dumps(err.value)).num_free == 6
    assert (pool.free_block_ids(), [pool.block_info(BlockId(b)) for b in range(6)]) == before
    assert pool.take_events() == [] and pool.stats().evictions == 0
    pool.check_integrity()


def test_free_order_is_the_order_given() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free(ids(2, 0, 3, 1))
    assert pool.free_block_ids() == [2, 0, 3, 1]
    assert pool.allocate(2) == [2, 0]


def test_over_free_is_rejected_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 1 2 time"):
        pool.free(ids(0, 1, 1))
    assert pool.free_block_ids() == [2, 3]
    pool.free(ids(1))
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids(1))
    with pytest.raises(ValueError, match="outside"):
        pool.free(ids(4))
    pool.check_integrity()


def test_touch_removes_from_middle_of_free_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    pool.cache_full_blocks(blocks, block_hashes(list(range(20)), BS, SALT))
    pool.free(blocks)
    pool.touch(ids(2, 2))
    assert pool.free_block_ids() == [0, 1, 3, 4]
    assert pool.block_info(BlockId(2)).ref_cnt == 2
    pool.free(ids(2))
    assert pool.free_block_ids() == [0, 1, 3, 4]
    pool.free(ids(2))
    assert pool.free_block_ids() == [0, 1, 3, 4, 2]
    pool.check_integrity()


def test_touch_of_free_uncached_block_is_rejected() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="caches nothing"):
        pool.touch(ids(1))
    assert pool.free_block_ids() == [0, 1, 2]


def test_duplicate_content_keeps_first_block() -> None:
    pool = BlockPool(4)
    h = block_hashes(list(range(8)), BS, SALT)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.cache_full_blocks(first, h)
    pool.take_events()
    pool.cache_full_blocks(second, h)  # the same content computed twice
    assert pool.take_events() == []
    assert [pool.get_cached_block(x) for x in h] == first
    assert pool.block_info(second[0]).block_hash is None
    pool.cache_full_blocks(first, h)   # re-caching the same hash on the same block: no-op
    assert pool.take_events() == [] and pool.num_cached_blocks == 2
    pool.check_integrity()


def test_cache_full_blocks_arguments() -> None:
    pool = BlockPool(4)
    h = block_hashes(list(range(12)), BS, SALT)
    blocks = pool.allocate(3)
    with pytest.raises(ValueError, match="3 hashes for 2 blocks"):
        pool.cache_full_blocks(blocks[:2], h)
    # a partial last block: more blocks than hashes; the chain continues from parent_hash
    pool.cache_full_blocks(blocks[1:], h[1:2], parent_hash=h[0])
    assert pool.take_events() == [BlockStored(h[1], h[0], blocks[1])]
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_blocks(blocks[1:2], h[2:3])
    with pytest.raises(ValueError, match="hold a reference"):
        pool.cache_full_blocks(ids(3), h[:1])


def test_prefix_caching_off() -> None:
    pool = BlockPool(4, enable_prefix_caching=False)
    h = block_hashes(list(range(16)), BS, SALT)
    blocks = pool.allocate(4)
    pool.cache_full_blocks(blocks, h)
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(h[0]) is None
    assert all(pool.block_info(b).block_hash is None for b in blocks)
    pool.free_sequence(blocks)
    assert pool.find_longest_prefix(h) == []
    assert pool.allocate(4) == [3, 2, 1, 0]
    assert pool.take_events() == [] and pool.stats().evictions == 0
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4)
    h = block_hashes(list(range(12)), BS, SALT)
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, h)
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # blocks in use
    assert pool.num_cached_blocks == 3 and pool.take_events() == []
    pool.free_sequence(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0 and pool.find_longest_prefix(h) == []
    assert pool.free_block_ids() == [3, 2, 1, 0]  # order kept
    assert pool.allocate(4) == [3, 2, 1, 0] and pool.take_events() == []
    pool.check_integrity()


def test_on_evict_runs_before_the_hash_is_dropped() -> None:
    calls: list[tuple[BlockId, BlockHash, BlockId | None]] = []
    pool: BlockPool

    def on_evict(block_ids: list[BlockId], block_hashes: list[BlockHash]) -> None:
        calls.append([(b, h, pool.get_cached_block(h)) for b, h in zip(block_ids, block_hashes)])

    pool = BlockPool(4, on_evict=on_evict)
    h = block_hashes(list(range(12)), BS, SALT)
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks, h)
    pool.free_sequence(blocks)           # free queue: 3, 2, 1, 0
    assert pool.allocate(3) == [3, 2, 1]
    assert calls == [[(BlockId(2), h[2], BlockId(2)), (BlockId(1), h[1], BlockId(1))]]  # one batch
    assert pool.get_cached_block(h[0]) == 0 and pool.get_cached_block(h[1]) is None


def test_on_evict_failure_leaves_pool_unchanged() -> None:
    def on_evict(block_ids: list[BlockId], block_hashes: list[BlockHash]) -> None:
        raise RuntimeError("host tier full")

    pool = BlockPool(2, on_evict=on_evict)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, block_hashes(list(range(8)), BS, SALT))
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.free_block_ids() == [0, 1] and pool.num_cached_blocks == 2
    pool.check_integrity()


def test_counters() -> None:
    pool = BlockPool(4)
    h = block_hashes(list(range(16)), BS, SALT)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, h[:2])
    assert pool.find_longest_prefix(h) == [0, 1]
    assert pool.find_longest_prefix(h[2:]) == []  # does not start with a cached hash
    assert pool.find_longest_prefix([]) == []
    assert pool.stats() == PoolStats(queries=3, hits=1, query_blocks=6, hit_blocks=2,
                                     evictions=0)
    assert [pool.block_info(b).ref_cnt for b in blocks] == [1, 1]  # queries don't touch


def test_events_can_be_disabled() -> None:
    pool = BlockPool(2, enable_kv_cache_events=False)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, block_hashes(list(range(8)), BS, SALT))
    pool.free(blocks)
    pool.allocate(2)
    assert pool.take_events() == [] and pool.stats().evictions == 2


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    pool._blocks[0].ref_cnt = 0  # a leaked block: neither used nor free
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_integrity()
    pool = BlockPool(4)
    pool._blocks[2].next = pool._blocks[1]  # a broken forward link
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_integrity()
    pool = BlockPool(4)
    blocks = pool.allocate(1)
    pool.cache_full_blocks(blocks, block_hashes(list(range(4)), BS, SALT))
    pool._blocks[0].block_hash = BlockHash(5)
    with pytest.raises(AssertionError, match="hash map"):
        pool.check_integrity()


@pytest.mark.multiproc
def test_pool_and_keys_are_torch_free() -> None:
    code = ("import sys, kvstore.pool, kvstore.keys, kvstore.errors; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                   check=True, timeout=30)


def _serve(pool: BlockPool, tokens: list[int]) -> list[BlockId]:
    """One request as the store admits it: reuse the cached prefix, allocate the rest, cache
    the full blocks; returns its blocks (free them with `free_sequence`)."""
    hashes = block_hashes(tokens, BS, SALT)
    found = pool.find_longest_prefix(hashes)
    pool.touch(found)
    blocks = found + pool.allocate(-(-len(tokens) // BS) - len(found))
    pool.cache_full_blocks(blocks, hashes)
    return blocks


@pytest.mark.parametrize("protected_frac, survives", [(0.8, True), (0.0, False)])
def test_a_reused_prefix_outlives_one_off_tails(protected_frac: float, survives: bool) -> None:
    """Segmented LRU: a prefix two requests shared stays cached while later one-off requests
    cycle through the rest of the pool; plain LRU (protected_frac=0) evicts it first. (With
    protection that never fades: 12 one-off blocks outlast the default fade, tested below.)"""
    pool = BlockPool(12, protected_frac=protected_frac, protect_turnovers=None)
    shared = list(range(1, 13))                          # 3 full blocks
    for question in ([100, 101, 102, 103], [200, 201, 202, 203]):
        pool.free_sequence(_serve(pool, shared + question))
    assert pool.num_reused_blocks == 3
    assert pool.num_protected_blocks == (3 if survives else 0)
    for i in range(6):                                   # one-off prompts, 2 blocks each
        pool.free_sequence(_serve(pool, [1000 + 10 * i + k for k in range(8)]))
        pool.check_integrity()
    hashes = block_hashes(shared, BS, SALT)
    assert len(pool.find_longest_prefix(hashes)) == (3 if survives else 0)


def test_protected_queue_is_capped_and_reset_clears_it() -> None:
    pool = BlockPool(10, protected_frac=0.2)             # at most 2 free protected blocks
    shared = list(range(1, 13))                          # 3 full blocks
    pool.free_sequence(_serve(pool, shared))
    pool.free_sequence(_serve(pool, shared))             # reused: all 3 protected, but cap 2
    assert pool.num_reused_blocks == 3 and pool.num_protected_blocks == 2
    # freed tail first, the cap moved the oldest (the tail block) back to probation's tail
    tail = pool.find_longest_prefix(block_hashes(shared, BS, SALT))[2]
    assert pool.free_block_ids()[-3] == tail
    pool.check_integrity()
    assert pool.reset_prefix_cache()
    assert pool.num_reused_blocks == pool.num_protected_blocks == 0
    pool.check_integrity()
    with pytest.raises(ValueError, match="protected_frac"):
        BlockPool(4, protected_frac=1.5)


@pytest.mark.parametrize("turnovers, reuse_every, survives", [
    (None, 0, True),     # protection that never fades keeps yesterday's prefix for good
    (1.0, 0, False),     # not reused for a pool's worth of allocations: stale, evicted by age
    (1.0, 3, True),      # reused within each turnover: keeps its protection
])
def test_protection_fades_when_a_prefix_goes_unused(turnovers: float | None, reuse_every: int,
                                                   survives: bool) -> None:
    """A shift: a prefix two requests shared, then only new one-off prompts. A stale protected
    block competes with the probation blocks by age, so it goes before newer one-offs."""
    pool = BlockPool(12, protect_turnovers=turnovers)
    shared = list(range(1, 13))                          # 3 full blocks
    hashes = block_hashes(shared, BS, SALT)
    for question in ([100, 101, 102, 103], [200, 201, 202, 203]):
        pool.free_sequence(_serve(pool, shared + question))
    assert pool.num_protected_blocks == 3
    for i in range(10):                                  # 20 blocks allocated: past one turnover
        if reuse_every and i % reuse_every == 0:
            pool.free_sequence(_serve(pool, shared + [300 + i] * 4))
        pool.free_sequence(_serve(pool, [1000 + 10 * i + k for k in range(8)]))
        pool.check_integrity()
    assert len(pool.find_longest_prefix(hashes)) == (3 if survives else 0)
    if not survives:                                     # evicted by age: the latest one-offs stay
        last = block_hashes([1000 + 90 + k for k in range(8)], BS, SALT)
        assert len(pool.find_longest_prefix(last)) == 2


def test_a_stale_block_still_waits_for_the_empty_ones() -> None:
    pool = BlockPool(12, protect_turnovers=0.25)          # stale after 3 allocations
    shared = list(range(1, 13))
    pool.free_sequence(_serve(pool, shared))
    pool.free_sequence(_serve(pool, shared))             # 3 protected blocks, 9 never used
    pool.free(pool.allocate(4))                          # the clock moves past 3; nothing cached
    assert pool.num_protected_blocks == 3
    order = pool.free_block_ids()
    protected = pool.find_longest_prefix(block_hashes(shared, BS, SALT))
    assert order[-3:] == list(reversed(protected))     # empty blocks first, then the stale ones
    with pytest.raises(ValueError, match="protect_turnovers"):
        BlockPool(4, protect_turnovers=0)


def test_protected_victims_counts_the_shared_blocks_an_allocation_would_evict() -> None:
    """`protected_victims(n, keep)`: of the next `n` blocks `allocate` takes (passing over the
    free cached blocks in `keep`), those caching a reused prefix that is not stale yet; a query."""
    pool = BlockPool(12, protect_turnovers=None)
    shared = list(range(1, 13))                          # 3 full blocks, reused: protected
    pool.free_sequence(_serve(pool, shared))
    pool.free_sequence(_serve(pool, shared))
    held = pool.allocate(7)                              # 2 probation blocks left, then the 3 protected
    free_before = pool.free_block_ids()
    assert [pool.protected_victims(n) for n in (0, 1, 2, 3, 5)] == [0, 0, 0, 1, 3]
    first = pool.find_longest_prefix(block_hashes(shared, BS, SALT))[:1]
    assert pool.protected_victims(3, keep=first) == 1    # the kept one is not a victim: the next one is
    assert pool.free_block_ids() == free_before and pool.stats().evictions == 0
    pool.free(held)
    assert pool.protected_victims(9) == 0                # 9 probation blocks come first now
    faded = BlockPool(12, protect_turnovers=0.25)        # stale after 3 allocations
    faded.free_sequence(_serve(faded, shared))
    faded.free_sequence(_serve(faded, shared))
    assert faded.protected_victims(12) == 3
    faded.free(faded.allocate(4))                        # the clock moves past 3: stale, no longer counted
    assert faded.protected_victims(12) == 0
