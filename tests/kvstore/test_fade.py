"""The protection's fade learns its window from the pool's mistakes (kvstore/fade.py)."""
from __future__ import annotations

import pytest

from kvstore.fade import MAX_TURNOVERS, MIN_TURNOVERS, Fade
from kvstore.keys import BlockHash
from kvstore.pool import BlockPool


def h(i: int) -> BlockHash:
    return BlockHash(i)


def test_a_probation_ghost_cached_again_shrinks_the_window_and_a_protected_one_grows_it() -> None:
    fade = Fade(64, turnovers=1.0, steps=16.0)          # a step: 64 / 16 = 4 allocations
    fade.evicted(h(1), protected=False)
    fade.evicted(h(2), protected=True)
    assert not fade.recached(h(3)) and fade.window == 64        # never evicted: no mistake
    assert fade.recached(h(1)) and fade.window == 60 and fade.shrinks == 1
    assert not fade.recached(h(1)) and fade.window == 60        # a ghost counts once
    assert fade.recached(h(2)) and fade.window == 64 and fade.grows == 1


def test_the_window_stays_within_its_bounds_and_the_ghosts_within_one_pool() -> None:
    fade = Fade(8, turnovers=1.0, steps=1.0)             # a step: a whole pool
    for i in range(20):
        fade.evicted(h(i), protected=False)
    assert not fade.recached(h(0))                       # forgotten: only the last 8 are kept
    for i in range(12, 20):
        fade.recached(h(i))
    assert fade.window == MIN_TURNOVERS * 8
    for i in range(100, 140):
        fade.evicted(h(i), protected=True)
        fade.recached(h(i))
    assert fade.window == MAX_TURNOVERS * 8


def test_a_fixed_window_keeps_no_ghosts() -> None:
    fade = Fade(8, turnovers=0.5, steps=None)
    fade.evicted(h(1), protected=False)
    assert not fade.recached(h(1)) and fade.window == 4
    with pytest.raises(ValueError, match="fade_steps"):
        Fade(8, turnovers=1.0, steps=0.0)


def _shift(fade_steps: float | None) -> tuple[list[int], float | None]:
    """A 48-block pool: three prefixes of 8 blocks asked twice each (protected), then three new
    ones asked in rounds, each with 2 one-off blocks. Blocks computed per round, final window."""
    pool = BlockPool(48, protect_turnovers=1.0, fade_steps=fade_steps, enable_kv_cache_events=False)

    def ask(prefix: list[BlockHash], one_off: int) -> int:
        found = pool.find_longest_prefix(prefix)
        pool.touch(found)
        rest = len(prefix) - len(found)
        fresh = pool.allocate(rest + one_off)
        pool.cache_full_blocks(fresh[:rest], prefix[len(found):])
        pool.free_sequence(found + fresh)
        return rest

    old = [[h(1000 * i + j) for j in range(8)] for i in range(3)]
    for _ in range(2):
        for prefix in old:
            ask(prefix, 1)
    new = [[h(5000 + 100 * i + j) for j in range(8)] for i in range(3)]
    computed = [sum(ask(prefix, 2) for prefix in new) for _ in range(4)]
    pool.check_integrity()
    return computed, pool.protect_window


def test_a_pool_that_learns_its_window_keeps_the_new_prefixes_a_fixed_window_computes_again() -> None:
    fixed, fixed_window = _shift(None)
    learned, window = _shift(16.0)
    assert fixed_window == 48 and window is not None and window < 48   # the mistakes shrank it
    assert learned[0] == fixed[0] == 24                  # the first round computes everything
    assert sum(learned) < sum(fixed), (learned, fixed)   # after that, fewer recomputed
    assert learned[-1] == fixed[-1] == 0                 # both settle


def _prefix_then_tail(shared: int) -> list[int]:
    """A 4-block pool: a 2-block prefix cached (`shared` of it hinted) and freed, then a one-off
    block cached and freed after it, then 2 blocks allocated: how much of the prefix is left."""
    pool = BlockPool(4, enable_kv_cache_events=False)
    prefix = pool.allocate(2)
    pool.cache_full_blocks(prefix, [h(1), h(2)], shared=shared)
    pool.free_sequence(prefix)
    tail = pool.allocate(1)
    pool.cache_full_blocks(tail, [h(9)])
    pool.free_sequence(tail)
    pool.allocate(2)
    pool.check_integrity()
    return pool.find_longest_prefix([h(1), h(2)])


def test_blocks_a_caller_calls_shared_are_protected_from_their_first_use() -> None:
    """`cache_full_blocks(shared=k)`: the first k newly cached blocks count as reused at once (a
    router's hint; kvmesh.bench.routing_sweeps.sweep_prefix_hint models it), so freed they are
    protected and outlive a one-off block freed after them, which plain LRU would keep instead."""
    assert len(_prefix_then_tail(shared=2)) == 2
    assert len(_prefix_then_tail(shared=0)) == 1     # the empty block and the prefix's tail block went
