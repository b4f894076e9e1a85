"""Which worker serves a request: filter → score → pick.

Policies see plain data (`WorkerInfo`, a `RouteRequest` of token ids and block hashes) and
never gRPC; the server owns connections and liveness and hands a policy the live workers.
Scores are floats in [0, 1]; the highest wins; a policy never raises on missing data.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NewType

from kvstore.keys import BlockHash

WorkerId = NewType("WorkerId", str)

_SCORE_BITS = 64


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker the router may send to: its id (from the worker) and gRPC address."""

    worker_id: WorkerId
    address: str


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing may look at: the prompt's token ids and the keys of its full blocks."""

    token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class PrefixHashPolicy:
    """Rendezvous (highest-random-weight) hashing of the prompt's first `num_prefix_blocks`.

    The key is the hash of the last of the first K full blocks (block hashes are chained, so
    it covers all K); a prompt shorter than one block is keyed by its token ids. Every
    worker scores `blake2b(key ‖ worker_id)`; the highest wins. So a prefix always goes to
    the same live worker, and removing a worker moves only the prefixes it owned.
    """

    num_prefix_blocks: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.num_prefix_blocks, bool) or not isinstance(self.num_prefix_blocks, int) \
                or self.num_prefix_blocks <= 0:
            raise ValueError(f"num_prefix_blocks={self.num_prefix_blocks!r} must be a positive integer")

    def pick(self, workers: Sequence[WorkerInfo], request: RouteRequest,
             exclude: Collection[WorkerId] = ()) -> WorkerInfo | None:
        """The chosen worker, or None when no worker is left after `exclude`."""
        candidates = [w for w in workers if w.worker_id not in exclude]
        if not candidates:
            return None
        key = self.route_key(request)
        return max(candidates, key=lambda w: (self.score(key, w), w.worker_id))

    def route_key(self, request: RouteRequest) -> bytes:
        if request.block_hashes:
            last = request.block_hashes[min(self.num_prefix_blocks, len(request.block_hashes)) - 1]
            return b"B" + last.to_bytes(16, "big")
        ids = request.token_ids
        return b"T" + hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=16).digest()

    @staticmethod
    def score(key: bytes, worker: WorkerInfo) -> float:
        """A stable pseudo-random weight in [0, 1) for (key, worker)."""
        digest = hashlib.blake2b(key + worker.worker_id.encode("utf-8"), digest_size=_SCORE_BITS // 8).digest()
        return int.from_bytes(digest, "big") / float(1 << _SCORE_BITS)
