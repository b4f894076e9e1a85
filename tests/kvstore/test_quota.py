"""Per-tenant caps on cached blocks (kvstore/quota.py through kvstore/pool.py): a tenant over
its cap gives its own free cached blocks to allocations before anyone else's."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.keys import BlockHash
from kvstore.pool import BlockId, BlockPool

_hashes = itertools.count(1)


def _cache(pool: BlockPool, n: int, owner: str | None) -> list[BlockId]:
    """Allocate `n` blocks, cache them for `owner` and free them (a finished request's prompt)."""
    ids = pool.allocate(n)
    pool.cache_full_blocks(ids, [BlockHash(next(_hashes)) for _ in ids], owner=owner)
    pool.free_sequence(ids)
    return ids


def test_a_tenant_over_its_cap_is_evicted_before_an_older_tenants_cache() -> None:
    pool = BlockPool(8, protected_frac=0.0)
    pool.set_owner_cap("beta", 2)
    alpha = _cache(pool, 2, "alpha")        # the oldest free blocks: plain LRU would evict them first
    beta = _cache(pool, 4, "beta")          # 2 over the cap
    pool.check_integrity()
    taken = pool.allocate(4)
    # the 2 empty blocks, then beta's own cached blocks back to its cap (tail first, as freed)
    assert taken == [6, 7, beta[3], beta[2]]
    assert all(pool.owner_of(b) == "alpha" for b in alpha)
    assert pool.owner_usage()["beta"].num_cached_blocks == 2
    pool.check_integrity()
    # beta at its cap: the pool's own order again (alpha's, the least recently freed)
    assert pool.allocate(1) == [alpha[1]]
    pool.check_integrity()


def test_without_an_owner_over_its_cap_the_order_is_the_plain_lru() -> None:
    capped, plain = BlockPool(8, protected_frac=0.0, max_cached_frac=0.5), BlockPool(8, protected_frac=0.0)
    for pool in (capped, plain):
        _cache(pool, 2, "alpha")
        _cache(pool, 3, "beta")             # under half of 8
    assert capped.allocate(6) == plain.allocate(6)
    capped.check_integrity()


def test_default_cap_is_a_fraction_of_the_pool_and_set_cap_overrides_it() -> None:
    pool = BlockPool(10, max_cached_frac=0.3)
    _cache(pool, 4, "beta")
    assert pool.owner_usage()["beta"] == (4, 4, 3)
    pool.set_owner_cap("beta", 5)
    assert pool.owner_usage()["beta"].cap == 5
    pool.set_owner_cap("beta", None)
    assert pool.owner_usage()["beta"].cap == 3
    with pytest.raises(ValueError, match="max_cached_frac"):
        BlockPool(4, max_cached_frac=0.0)
    with pytest.raises(ValueError, match="max_cached_blocks"):
        pool.set_owner_cap("beta", -1)


def test_reused_blocks_and_reset_keep_the_owner_counts() -> None:
    pool = BlockPool(6, protected_frac=0.5)
    pool.set_owner_cap("beta", 1)
    ids = _cache(pool, 3, "beta")
    pool.touch(ids[:2])                     # reused: protected when freed again
    pool.free_sequence(ids[:2])
    pool.check_integrity()
    assert pool.allocate(4) == [3, 4, 5, ids[2]]   # empties, then beta's never-reused block first
    pool.check_integrity()
    assert pool.reset_prefix_cache() is False
    pool.free([3, 4, 5, ids[2]])
    assert pool.reset_prefix_cache() is True
    assert pool.owner_usage() == {}
    pool.check_integrity()


def test_unowned_blocks_are_never_capped() -> None:
    pool = BlockPool(4, max_cached_frac=0.25)
    _cache(pool, 4, None)
    assert pool.owner_usage() == {}
    assert pool.allocate(2) == [3, 2]       # LRU: tail of the freed sequence first


class QuotaMachine(RuleBasedStateMachine):
    """Random requests of alpha (uncapped) and beta (capped) over one pool; the oracle: an
    allocation evicts alpha's cached blocks only after every empty free block and beta's free
    cached blocks down to its cap were taken."""

    NUM_BLOCKS = 24
    BETA_CAP = 5

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, protected_frac=0.5)
        self.pool.set_owner_cap("beta", self.BETA_CAP)
        self.held: list[tuple[str, list[BlockId]]] = []
        self.cached: dict[str, list[BlockHash]] = {"alpha": [], "beta": []}

    def _free_cached(self, owner: str) -> int:
        u = self.pool.owner_usage().get(owner)
        return u.num_free_cached_blocks if u else 0

    def _num_cached(self, owner: str) -> int:
        u = self.pool.owner_usage().get(owner)
        return u.num_cached_blocks if u else 0

    @rule(owner=st.sampled_from(["alpha", "beta"]), n=st.integers(1, 6), reuse=st.booleans())
    def start(self, owner: str, n: int, reuse: bool) -> None:
        hits: list[BlockId] = []
        if reuse and self.cached[owner]:
            found = self.pool.find_longest_prefix(self.cached[owner][:1])
            if found:
                self.pool.touch(found)
                hits = found
        if n > self.pool.num_free_blocks:
            if hits:
                self.pool.free(hits)
            return
        empty = sum(1 for b in self.pool.free_block_ids() if self.pool.block_info(b).block_hash is None)
        beta_excess = max(0, self._num_cached("beta") - self.BETA_CAP)
        beta_spare = min(beta_excess, self._free_cached("beta"))
        alpha_before, beta_before = self._num_cached("alpha"), self._num_cached("beta")
        ids = self.pool.allocate(n)
        alpha_lost = alpha_before - self._num_cached("alpha")
        beta_lost = beta_before - self._num_cached("beta")
        if alpha_lost:
            assert n - alpha_lost >= empty + beta_spare, (n, alpha_lost, empty, beta_spare)
        assert beta_lost >= min(beta_spare, max(0, n - empty))
        hashes = [BlockHash(next(_hashes)) for _ in ids]
        self.pool.cache_full_blocks(ids, hashes, owner=owner)
        self.cached[owner] = hashes + self.cached[owner][:8]
        self.held.append((owner, hits + ids))

    @precondition(lambda self: bool(self.held))
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        _, ids = self.held.pop(i % len(self.held))
        self.pool.free_sequence(ids)

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()


TestQuotaMachine = QuotaMachine.TestCase
TestQuotaMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
