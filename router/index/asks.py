"""Evidence that a block is shared, fading with the traffic that passes it by.

`router/index/blocks.py` counts, per block, the requests whose prompts asked for it (up to
two) and when the last one did, on a *traffic clock*: the prompt blocks routed so far over
the cluster's pool capacity (`BlockIndex.set_capacity`), so the clock reads in pool-fulls of
traffic. A block's evidence is its shared-ness (1 when two prompts asked for it, else its
depth's reuse rate) times 2^(−age / half-life), age the traffic since its last ask: a prefix
nobody asks for any more fades into room while the new traffic fills the pools.

The decay is applied lazily, on read: each tally keeps its blocks' weights relative to a
base time (`Decay.weight`: 2^((at − base) / half-life)), and a read scales the sum by
2^(−(now − base) / half-life) once. No timer walks the index; the base moves (every tally
rebuilt, O(entries)) only once the weights would grow past 2^`_REBASE_HALF_LIVES`.

`ASK_HALF_LIFE`, the default, is measured: kv_aware over the simulated routing-live scenarios
(no pressure, pressure, shift; quick and default sizes) at half-lives 0.5 … ∞, with
`kvmesh.bench.routing_sweeps.sweep_ask_half_life` (its docstring has the command; docs/routing.md the
figures): 4 pool-fulls had the fewest cold requests and the lowest imbalance in the default
shift and cost pressure next to nothing; shorter ones cost the pressure scenario hits.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from kvstore.events import WorkerId
from kvstore.keys import BlockHash

DEPTHS = 256   # depth buckets of the reuse rate; deeper blocks share the last
ASK_HALF_LIFE = 4.0        # pool-fulls of routed prompt blocks; chosen by the sweep (module docstring)
# Pool-fulls of traffic after its first ask past which a block not asked again counts against its
# depth's reuse in the shared-prefix hint (`Reuse.settled`); before, it is too young to tell.
HINT_SETTLE = 2.0
# Base-relative weights stay within 2^_REBASE_HALF_LIVES so the running sums keep every block's
# part (float64 carries 53 bits: a wider range would lose a small weight beside a large one).
_REBASE_HALF_LIVES = 20.0
_VECTOR_KEYS = 16          # `TallyTable.move` over this many keys or more: numpy steps, not a loop


class Ask(NamedTuple):
    """One block's asks: how many requests (up to 2), its depth bucket, the clock at the last."""

    num_asks: int
    depth: int
    at: float


class Decay:
    """The traffic clock and the half-life its weights decay with (`half_life` = inf: never)."""

    __slots__ = ("half_life", "now", "base")

    def __init__(self, half_life: float) -> None:
        if not half_life > 0.0:
            raise ValueError(f"ask_half_life={half_life!r} must be > 0")
        self.half_life = half_life
        self.now = 0.0
        self.base = 0.0

    def weight(self, ask: Ask) -> float:
        """`ask`'s weight relative to the base (its evidence now times `scale()`'s inverse)."""
        return 2.0 ** ((ask.at - self.base) / self.half_life)

    def scale(self) -> float:
        """What a base-relative weight is worth now."""
        return 2.0 ** (-(self.now - self.base) / self.half_life)

    def needs_rebase(self) -> bool:
        return (self.now - self.base) / self.half_life > _REBASE_HALF_LIVES and math.isfinite(self.half_life)


class Tally:
    """Blocks held in one scope (a worker, or the distinct blocks held anywhere) by their asks,
    as base-relative weights: `shared` those two or more requests asked for, `once[depth]` one."""

    __slots__ = ("shared", "once")

    def __init__(self) -> None:
        self.shared = 0.0
        self.once: dict[int, float] = {}

    def count(self, ask: Ask, weight: float, sign: int) -> None:
        """Add (+1) or take away (−1) one held block whose asks are `ask` (weight `weight`)."""
        if ask.num_asks >= 2:
            self.shared += sign * weight
        else:
            self.once[ask.depth] = self.once.get(ask.depth, 0.0) + sign * weight

    def expected(self, first: Sequence[int], again: Sequence[int], scale: float) -> float:
        """The shared blocks, expected and decayed: those asked for twice, plus those asked for
        once at the rate blocks of their depth were asked for again (`again` of `first`,
        smoothed), each at its weight now."""
        rates = sum(n * (again[d] + 1) / (first[d] + 2) for d, n in sorted(self.once.items()))
        return max(0.0, scale * (self.shared + rates))

    def held(self, scale: float) -> float:
        """The blocks counted here at their weight now, every one in full (not discounted by the
        chance that it is asked for again): the pool space the prompts' blocks fill, fading."""
        return max(0.0, scale * (self.shared + sum(v for _, v in sorted(self.once.items()))))

    def check(self, other: Tally, what: str) -> None:
        """AssertionError unless this tally equals `other` (recounted from the blocks), up to
        the rounding of the running sums."""
        def close(a: float, b: float) -> bool:
            return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))
        assert close(self.shared, other.shared), f"{what} counts {self.shared} shared, holds {other.shared}"
        for d in set(self.once) | set(other.once):
            mine, held = self.once.get(d, 0.0), other.once.get(d, 0.0)
            assert close(mine, held), f"{what} counts {mine} blocks asked once at depth {d}, holds {held}"


class TallyTable:
    """One `Tally` per key (a worker) as a row of numpy arrays, so that every worker's expected
    shared blocks come out of one vectorized pass per routing decision (`expected`) instead of a
    Python sum per worker. A row's figures are the very floats a `Tally` keeps (the same
    additions, in the same order), and `expected` sums each row's depths in ascending order,
    left to right, as `Tally.expected` does: the two agree to the last bit."""

    def __init__(self, capacity: int = 16) -> None:
        self._rows: dict[WorkerId, int] = {}
        self._free: list[int] = []
        self.shared = np.zeros(capacity)
        self.once = np.zeros((DEPTHS, capacity))    # [depth, row]: a depth's figures side by side
        self.nonzero = np.zeros(DEPTHS, dtype=np.int64)  # per depth: the rows not 0.0 there (the rest add 0)
        self.depths = 0             # 1 + the deepest depth counted (columns past it are zero)
        self.version = 0            # moves whenever a key gets or loses its row
        self._moved: tuple[int, frozenset[WorkerId], np.ndarray] | None = None   # `move`'s last keys

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def keys(self) -> list[WorkerId]:
        return list(self._rows)

    def rows(self, keys: Sequence[WorkerId]) -> np.ndarray:
        """The row of each of `keys` (-1: none)."""
        get = self._rows.get
        return np.array([get(k, -1) for k in keys], dtype=np.intp)

    def _row(self, key: WorkerId) -> int:
        r = self._rows.get(key)
        if r is None:
            if self._free:
                r = self._free.pop()
            else:
                r = len(self._rows)
                if r == len(self.shared):
                    self.shared = np.concatenate([self.shared, np.zeros(r)])
                    self.once = np.concatenate([self.once, np.zeros((DEPTHS, r))], axis=1)
            self._rows[key] = r
            self.version += 1
        return r

    def count(self, key: WorkerId, ask: Ask, weight: float, sign: int) -> None:
        """`Tally.count` on `key`'s row."""
        r = self._row(key)
        if ask.num_asks >= 2:
            self.shared[r] += sign * weight
        else:
            at = self.once[ask.depth]
            before = at[r]
            at[r] = after = before + sign * weight
            self.nonzero[ask.depth] += int(after != 0.0) - int(before != 0.0)
            if ask.depth >= self.depths:
                self.depths = ask.depth + 1

    def move(self, keys: Collection[WorkerId], old: Ask | None, old_weight: float, new: Ask,
             new_weight: float) -> None:
        """For each of `keys` (distinct): `count(key, old, old_weight, -1)` unless `old` is None,
        then `count(key, new, new_weight, +1)` — a block whose asks changed, on every worker
        holding it. Past `_VECTOR_KEYS` keys (a shared prefix's holders: hundreds at 1,000
        workers) as two vectorized steps over their rows: the same float operation per row,
        in the same order, so the rows end bit-equal to the calls'."""
        if len(keys) < _VECTOR_KEYS:
            for key in keys:
                if old is not None:
                    self.count(key, old, old_weight, -1)
                self.count(key, new, new_weight, +1)
            return
        same = frozenset(keys)      # a prefix's blocks mostly share their holders: their rows once
        if self._moved is not None and self._moved[0] == self.version and self._moved[1] == same:
            rows = self._moved[2]
        else:
            get = self._rows.get
            found = [get(k, -1) for k in keys]
            if -1 in found:
                found = [r if r >= 0 else self._row(k) for k, r in zip(keys, found)]
            rows = np.array(found, dtype=np.intp)
            self._moved = (self.version, same, rows)
        if old is not None:
            self._add(rows, old, -old_weight)
        self._add(rows, new, new_weight)

    def _add(self, rows: np.ndarray, ask: Ask, value: float) -> None:
        if ask.num_asks >= 2:
            self.shared[rows] += value
            return
        at = self.once[ask.depth]
        before = at[rows]
        after = before + value
        at[rows] = after
        self.nonzero[ask.depth] += int(np.count_nonzero(after)) - int(np.count_nonzero(before))
        if ask.depth >= self.depths:
            self.depths = ask.depth + 1

    def pop(self, key: WorkerId) -> None:
        r = self._rows.pop(key, None)
        if r is not None:
            self.shared[r] = 0.0
            self.nonzero -= self.once[:, r] != 0.0
            self.once[:, r] = 0.0
            self._free.append(r)
            self.version += 1

    def load(self, tallies: Mapping[WorkerId, Tally]) -> None:
        """Replace every row by `tallies` (a recount)."""
        for key in list(self._rows):
            self.pop(key)
        for key, tally in tallies.items():
            r = self._row(key)
            self.shared[r] = tally.shared
            for d, n in tally.once.items():
                self.once[d, r] = n
                self.nonzero[d] += n != 0.0
                self.depths = max(self.depths, d + 1)

    def tally(self, key: WorkerId) -> Tally:
        """`key`'s row as a `Tally` (its zero depths left out)."""
        out = Tally()
        r = self._rows.get(key)
        if r is not None:
            out.shared = float(self.shared[r])
            out.once = {d: float(n) for d, n in enumerate(self.once[:self.depths, r]) if n != 0.0}
        return out

    def expected(self, rows: np.ndarray, first: Sequence[int], again: Sequence[int], scale: float) -> np.ndarray:
        """`Tally.expected` of each of `rows` (row numbers; -1: no row, 0.0)."""
        d = self.depths
        rows = np.asarray(rows, dtype=np.intp)
        safe = np.where(rows >= 0, rows, 0)
        shared = self.shared[safe]
        active = np.flatnonzero(self.nonzero[:d])     # the depths where some row is not 0.0
        if len(active) and len(rows):
            # every row up to the highest asked for, a depth at a time (contiguous: no gather of
            # rows × depths): n * (again + 1) / (first + 2) as Tally.expected computes it, in
            # place, then each row's terms added in ascending depth, left to right — a reduce
            # over the outer axis of a C-ordered block is that loop, row by row (no pairwise
            # summation: that is for the contiguous axis) — the depths left out would add 0.0
            hi = int(safe.max()) + 1
            terms = self.once[active, :hi]
            terms *= np.array([again[j] for j in active.tolist()], dtype=float)[:, None] + 1.0
            terms /= np.array([first[j] for j in active.tolist()], dtype=float)[:, None] + 2.0
            shared = shared + np.add.reduce(terms, axis=0)[safe]
        out = np.maximum(0.0, scale * shared)
        out[rows < 0] = 0.0
        return out


class Reuse:
    """Per depth bucket, the blocks first asked for (`first`), those of them asked for again
    (`again`), and those *settled* (`settled`): asked for again, or first asked `settle`
    pool-fulls of traffic ago or more. A block asked once a moment ago has had no time to be
    asked again: counted in `first` at once, it holds the reuse rate down while a workload starts
    (8 of 12 prefixes seen, 4 of them asked again, in `kvmesh bench routing-live --quick`'s
    pressure run: 0.5, where each is asked for four times). `again / settled` leaves the young
    ones out until they show which way they go (a survival estimate's censoring)."""

    __slots__ = ("first", "again", "settled", "settle", "_young", "_young_again")

    def __init__(self, settle: float = HINT_SETTLE) -> None:
        self.first = [0] * DEPTHS
        self.again = [0] * DEPTHS
        self.settled = [0] * DEPTHS
        self.settle = settle
        self._young: deque[tuple[float, int, BlockHash]] = deque()   # (first ask, depth, block), oldest first
        self._young_again: set[tuple[BlockHash, float]] = set()      # of those, asked for again already

    def asked_first(self, h: BlockHash, depth: int, now: float) -> None:
        self.first[depth] += 1
        self._young.append((now, depth, h))

    def asked_again(self, h: BlockHash, first: Ask, now: float) -> None:
        """`h`, first asked at `first.at` (its `Ask` while it had one ask), is asked again."""
        self.again[first.depth] += 1
        self.settled[first.depth] += 1
        if first.at > now - self.settle:
            self._young_again.add((h, first.at))

    def advance(self, now: float) -> None:
        """The clock reads `now`: first asks `settle` old or more settle, unless already counted."""
        young, limit = self._young, now - self.settle
        while young and young[0][0] <= limit:
            at, depth, h = young.popleft()
            if (h, at) in self._young_again:
                self._young_again.discard((h, at))
            else:
                self.settled[depth] += 1

    def __len__(self) -> int:
        """First asks still young (kept here until they settle)."""
        return len(self._young)


class HeldBlocks(Protocol):
    def distinct_held_blocks(self) -> float: ...


def shared_prefix(asked: Container[BlockHash], settled: Sequence[int], again: Sequence[int],
                  block_hashes: Sequence[BlockHash]) -> int:
    """How many leading `block_hashes` a request asking for them now will likely share with
    others: each is a block an earlier request asked for (`asked`), or sits at a depth whose
    settled blocks were asked for again more often than not (`again[d] > settled[d] / 2`:
    `Reuse`, the young ones left out). The router sends it to the worker, whose pool protects
    those blocks from their first use (proto GenerateRequest.shared_prefix_blocks)."""
    n = 0
    for depth, h in enumerate(block_hashes):
        d = min(depth, DEPTHS - 1)
        if h not in asked and 2 * again[d] <= settled[d]:
            break
        n += 1
    return n


def cluster_fill(index: HeldBlocks, capacity: int) -> float:
    """The fraction of the pools' `capacity` that the distinct blocks held anywhere fill, each
    block a prompt asked for at its fading weight (`Tally.held` of the index's tally of the
    distinct blocks; a block nobody asked for counts nothing): the `R` a copy of a prefix is
    priced at (router/routing/scorers.py `PrefillCostScorer`). Not the expected shared blocks
    (`BlockIndex.distinct_shared_blocks`): a prefix asked for once so far counts there at its
    depth's reuse rate, which runs behind while a workload starts (0.37 with 8 of 12 prefixes
    seen in `kvmesh bench routing-live --quick`'s pressure run, 0.92 by its end). `index`: a
    `router.index.blocks.BlockIndex`."""
    if capacity <= 0:
        return 0.0
    return min(1.0, index.distinct_held_blocks() / capacity)


def recount(by_worker: Mapping[WorkerId, Iterable[BlockHash]], held_anywhere: Iterable[BlockHash],
            asked: Mapping[BlockHash, Ask], decay: Decay) -> tuple[dict[WorkerId, Tally], Tally]:
    """The tallies counted afresh: per worker over the blocks it holds, and over the distinct
    blocks held anywhere, each block by its asks (those without any count nothing)."""
    held: dict[WorkerId, Tally] = {}
    for w, hashes in by_worker.items():
        tally = held[w] = Tally()
        for h in hashes:
            if (seen := asked.get(h)) is not None:
                tally.count(seen, decay.weight(seen), +1)
    anywhere = Tally()
    for h in held_anywhere:
        if (seen := asked.get(h)) is not None:
            anywhere.count(seen, decay.weight(seen), +1)
    return held, anywhere
