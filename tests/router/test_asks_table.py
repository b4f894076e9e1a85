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
