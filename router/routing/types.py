"""The vocabulary of routing: what a policy sees (workers, their load, the prompt's block
hashes, how many leading blocks each worker holds) and the two kinds of parts a policy is
built from — filters and scorers (router/routing/scorers.py), combined in router/routing/policy.py.

Plain data only: no gRPC, no Redis, no torch. The router core (router/routing/core.py) builds a
`RoutingState` per request from its worker registry and the block index.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from contracts.roles import WorkerRole
from kvstore.events import WorkerId
from kvstore.keys import BlockHash

__all__ = ["WorkerId", "WorkerInfo", "WorkerLoad", "RouteRequest", "RoutingState", "RoutingPolicy",
           "Scorer", "Filter"]


class RoutingPolicy(enum.Enum):
    """The routing policies `--routing-policy` accepts; the value is the CLI spelling."""

    KV_AWARE = "kv_aware"
    PREFIX_HASH = "prefix_hash"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"

    @classmethod
    def parse(cls, value: RoutingPolicy | str) -> RoutingPolicy:
        """The member for a member or its CLI spelling; raises ValueError naming the accepted ones."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"routing_policy={value!r}; accepted: {', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker the router may send to: its id (from the worker), gRPC address and role
    (disaggregated serving, router/routing/disagg.py)."""

    worker_id: WorkerId
    address: str
    role: WorkerRole = WorkerRole.MIXED


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    in_flight: int = 0            # requests the router has open on it
    free_blocks: int = 0          # from the worker's last GetLoad
    num_blocks: int = 0           # 0: the worker has not reported its pool yet
    reused_blocks: int = 0        # cached blocks a later request reused (in use or free)
    shared_blocks: float = 0.0    # blocks it holds that 2+ requests' prompts held, expected (the router's index)
    disk_read_cost: float = 0.0   # reading a block back from its disk tier / computing it (GetLoad; 0: unmeasured)

    @property
    def committed(self) -> float:
        """The fraction of the pool holding shared prefixes (0 without a report): the chance
        that a block placed there now displaces one of them, sooner or later. Shared: the
        router index's expected shared blocks, whose evidence fades with the traffic that
        passes them by (router/index/asks.py); the worker's `reused_blocks` never fades (a
        block reused once stays so until evicted), so a pool of cold blocks would look full."""
        if self.num_blocks <= 0:
            return 0.0
        return min(1.0, max(0.0, self.shared_blocks) / self.num_blocks)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing may look at: the prompt's token ids and the keys of its full blocks."""

    token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class RoutingState:
    """Per-request view: load per worker and leading prompt blocks each worker holds.
    A worker missing from a map has no data (it scores 0 there)."""

    loads: Mapping[WorkerId, WorkerLoad] = field(default_factory=dict)
    cached_blocks: Mapping[WorkerId, int] = field(default_factory=dict)   # held or pending (being computed)
    # Uncached prompt tokens of requests sent to the worker that have not started streaming
    # (its prefill queue), less those computing this request's own prefix there.
    queued_tokens: Mapping[WorkerId, int] = field(default_factory=dict)
    block_size: int = 16
    # Sustained load: in-flight requests averaged over the last minute or so (router/routing/inflight.py).
    mean_in_flight: Mapping[WorkerId, float] = field(default_factory=dict)
    # Leading prompt blocks beyond its own `cached_blocks` that the worker can fetch from a
    # peer that has stored them (peer transfer; 0 or missing without a peer plane).
    fetchable_blocks: Mapping[WorkerId, int] = field(default_factory=dict)
    # The fraction of the pool's capacity (all its workers') the prompts' blocks fill with one copy
    # each, at their fading weight (router/index/asks.py `cluster_fill`): a replica displaces
    # someone's only copy with that chance.
    cluster_committed: float = 0.0
    # Of `cached_blocks`, those the worker holds in its disk tier only (read back before they
    # count); missing: none, or a worker whose disk reads are not priced (`disk_read_cost` 0).
    disk_blocks: Mapping[WorkerId, int] = field(default_factory=dict)

    def load(self, worker_id: WorkerId) -> WorkerLoad:
        return self.loads.get(worker_id, _NO_LOAD)


_NO_LOAD = WorkerLoad()


class Scorer(Protocol):
    """Scores every worker of `pool` (the candidates before filtering) in [0, 1]; higher is
    better. Missing data scores 0; a scorer never raises on what the state lacks. A scorer
    may keep state across calls (a rotation); it is called once per pick."""

    def score(self, pool: Sequence[WorkerInfo], request: RouteRequest,
              state: RoutingState) -> dict[WorkerId, float]: ...


class Filter(Protocol):
    """Narrows `pool` to the workers a pick may choose; never returns an empty list for a
    non-empty pool (a filter that would reject everyone keeps everyone)."""

    def keep(self, pool: Sequence[WorkerInfo], request: RouteRequest, state: RoutingState) -> list[WorkerInfo]: ...


def decode_pool(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    """The workers a request may decode on: all but the prefill-role ones, unless those are
    all there is (a last resort: a prefill worker decodes like a mixed one)."""
    pool = [w for w in workers if w.role is not WorkerRole.PREFILL]
    return pool if pool else list(workers)
