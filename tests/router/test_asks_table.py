"""router/index/asks.py `TallyTable`: each row is the `Tally` the same counts make, and its
vectorized `expected` is `Tally.expected` to the last bit, for any rows asked for (one, all,
a permutation, none, unknown keys), through row growth, pops (reused rows) and a reload."""
from __future__ import annotations

import random

import numpy as np

from kvstore.events import WorkerId
from router.index.asks import DEPTHS, Ask, Tally, TallyTable


def test_the_table_expects_what_each_tally_expects_bit_for_bit() -> None:
    rng = random.Random(7)
    table, tallies = TallyTable(capacity=2), dict[WorkerId, Tally]()
    keys = [WorkerId(f"w{i}") for i in range(40)]
    for step in range(3000):
        key = rng.choice(keys)
        ask = Ask(rng.choice([1, 1, 2]), rng.choice([0, 1, 5, 31, 32, 37, rng.randrange(DEPTHS)]), 0.0)
        weight, sign = rng.choice([1.0, 0.37, rng.random() * 9, 2.0 ** rng.randrange(-20, 20)]), rng.choice([1, 1, -1])
        table.count(key, ask, weight, sign)
        tallies.setdefault(key, Tally()).count(ask, weight, sign)
        if step % 700 == 699:                       # a worker leaves; its row is reused later
            gone = rng.choice(list(tallies))
            table.pop(gone)
            del tallies[gone]
        if step == 2000:
            table.load(tallies)
        if step % 50 == 0:
            first = [rng.randrange(100) for _ in range(DEPTHS)]
            again = [rng.randrange(f + 1) for f in first]
            scale = rng.choice([1.0, 0.5, rng.random()])
            asked = rng.choice([keys, keys[:1], list(reversed(keys)), [], [WorkerId("nobody"), *keys[3:9]]])
            got = table.expected(table.rows(asked), first, again, scale)
            want = [tallies[k].expected(first, again, scale) if k in tallies else 0.0 for k in asked]
            assert got.tolist() == want, step
            assert isinstance(got, np.ndarray) and got.shape == (len(asked),)
            assert table.nonzero.tolist() == np.count_nonzero(table.once, axis=1).tolist(), step
    for key, tally in tallies.items():
        mine = table.tally(key)
        assert mine.shared == tally.shared
        assert mine.once == {d: n for d, n in tally.once.items() if n != 0.0}


def test_move_leaves_each_row_as_the_count_calls_do_bit_for_bit() -> None:
    """`TallyTable.move` (a block whose asks changed, on all its holders) against the same
    `count` calls, key by key: small holder sets (the loop) and large ones (the vectorized
    steps, with rows reused across calls and rows created for keys that had none)."""
    rng = random.Random(11)
    moved, counted = TallyTable(capacity=2), TallyTable(capacity=2)
    keys = [WorkerId(f"w{i}") for i in range(300)]
    for step in range(400):
        holders = rng.sample(keys, rng.choice([1, 3, 15, 16, 40, 299])) if step % 3 else keys[:64]
        old = None if rng.random() < 0.3 else Ask(rng.choice([1, 2]), rng.choice([0, 3, 31]), 0.0)
        new = Ask(rng.choice([1, 2]), rng.choice([0, 3, 31, 200]), 0.0)
        w_old, w_new = rng.random() * 7, 2.0 ** rng.randrange(-10, 10)
        moved.move(dict.fromkeys(holders), old, w_old, new, w_new)
        for k in holders:
            if old is not None:
                counted.count(k, old, w_old, -1)
            counted.count(k, new, w_new, +1)
        if step % 97 == 96:                         # a worker leaves: its row is reused
            gone = rng.choice(keys)
            moved.pop(gone)
            counted.pop(gone)
    assert moved.nonzero.tolist() == np.count_nonzero(moved.once, axis=1).tolist()
    assert moved.depths == counted.depths
    for k in keys:
        mine, want = moved.tally(k), counted.tally(k)
        assert mine.shared == want.shared, k
        assert mine.once == want.once, k
