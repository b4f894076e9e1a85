"""Hit predictions that correct themselves: per worker, the router compares the prompt tokens
its block index said the chosen worker holds (`Pick.predicted_tokens`) with the tokens the
worker served from its own cache (`GenerateResponse.cached_tokens` less `peer_cached_tokens`).

The error of one request is (predicted − served) / prompt tokens, in [−1, 1]: positive when
the index promised blocks the worker did not have. A worker's over-prediction is averaged
over its last requests (an EWMA of max(0, error), weight `ewma_weight`); when that average
passes `threshold` the error is no race between an eviction and a pick but a stale index (a
worker that lost its blocks without telling, a lost event): `observe` returns a `Correction`,
the blocks this request was promised and not served, which the router drops from the index
before asking the worker for a full inventory (router/routing/core.py). The average starts
again from 0 after a correction. `shown` is what the dashboard sets beside each worker: the
signed error's running average (same weight) and the corrections so far. Owned by the router
core, on its loop; torch-free.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.keys import BlockHash
from router.routing.types import RouteRequest, WorkerId

log = logging.getLogger("kvmesh.router")


@dataclass(frozen=True, slots=True)
class PredictionConfig:
    ewma_weight: float = 0.3     # a request's share in the running average of a worker's over-prediction
    threshold: float = 0.3       # that average past which the worker's index entries are corrected

    def __post_init__(self) -> None:
        if not 0.0 < self.ewma_weight <= 1.0:
            raise ValueError(f"ewma_weight={self.ewma_weight!r} must be in (0, 1]")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold={self.threshold!r} must be in (0, 1)")


class Correction(NamedTuple):
    """`worker_id`'s index entries for `lost` (promised, not served) are stale: drop them and
    ask the worker for an inventory."""

    worker_id: WorkerId
    lost: tuple[BlockHash, ...]


class Observed(NamedTuple):
    error: float                     # (predicted − served) / prompt tokens, in [−1, 1]
    correction: Correction | None


class Shown(NamedTuple):
    mean_error: float                # the signed error's running average
    corrections: int                 # corrections of this worker's index entries so far


class HitPredictions:
    """Per worker, the running average of its over-prediction; see the module docstring."""

    def __init__(self, cfg: PredictionConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else PredictionConfig()
        self._ewma: dict[WorkerId, float] = {}
        self._shown: dict[WorkerId, Shown] = {}

    def observe(self, worker_id: WorkerId, route: RouteRequest, predicted_tokens: int, served_tokens: int,
                block_size: int) -> Observed:
        """One finished request on `worker_id`: its error, and a correction when the worker's
        average over-prediction passed the threshold."""
        prompt = max(1, len(route.token_ids))
        error = max(-1.0, min(1.0, (predicted_tokens - served_tokens) / prompt))
        if predicted_tokens != served_tokens:
            log.info("kvmesh router: hit mismatch on %s: the index predicted %d cached prompt tokens, it served %d",
                     worker_id, predicted_tokens, served_tokens)
        a = self.cfg.ewma_weight
        mean = self._ewma[worker_id] = (1.0 - a) * self._ewma.get(worker_id, 0.0) + a * max(0.0, error)
        shown = self.shown(worker_id)
        self._shown[worker_id] = shown = shown._replace(mean_error=(1.0 - a) * shown.mean_error + a * error)
        if mean <= self.cfg.threshold or block_size <= 0:
            return Observed(error, None)
        self._ewma[worker_id] = 0.0
        self._shown[worker_id] = shown._replace(corrections=shown.corrections + 1)
        served_blocks = max(0, served_tokens) // block_size
        lost = route.block_hashes[served_blocks:max(served_blocks, predicted_tokens // block_size)]
        log.warning("kvmesh router: worker %s keeps serving fewer cached tokens than its index entries promise "
                    "(%d predicted, %d served); dropping %d stale blocks, asking for its inventory",
                    worker_id, predicted_tokens, served_tokens, len(lost))
        return Observed(error, Correction(worker_id, tuple(lost)))

    def shown(self, worker_id: WorkerId) -> Shown:
        """`worker_id`'s figures for the dashboard (zeros for a worker never seen)."""
        return self._shown.get(worker_id, _NONE)


_NONE = Shown(0.0, 0)
