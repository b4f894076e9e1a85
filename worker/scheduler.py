"""Continuous batching over the block pool (the vLLM v1 unified token view).

Every request has `num_tokens` (prompt + output) and `num_computed_tokens` (K/V in the
cache). A step schedules, per request, the next `num_tokens - num_computed_tokens` tokens
under a token budget: a whole or chunked prefill, or one decode token. Running requests go
first; when blocks run out the most recently admitted running request is preempted (its
blocks freed, recomputed later — its own full blocks usually still sit in the prefix cache).
Waiting requests are admitted while budget, sequence slots and blocks allow, after a
prefix-cache lookup that sets `num_cached_tokens`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvstore.errors import OutOfBlocks
from kvstore.keys import BlockHash
from kvstore.pool import BlockId, BlockPool
from worker.request import NO_BLOCK, FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    sliding_window: int | None = None   # the model's: blocks wholly outside it are released

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class PrefixSource(Protocol):
    """Blocks of a prefix held outside the device pool (the host tier): asked on admission
    for the blocks that follow the device pool's hit."""

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading `block_hashes` it can load (a query)."""

    def load(self, block_hashes: Sequence[BlockHash], allocate: Allocate) -> list[BlockId]:
        """Take `len(block_hashes)` device blocks from `allocate` and fill them with those
        blocks' K/V; returns them (owned by the caller). The source must hold what it
        loads before calling `allocate`, whose evictions may reach the source itself."""


class Allocate(Protocol):
    def __call__(self, n: int) -> list[BlockId]: ...


class NoPrefixSource:
    """No tier behind the device pool: nothing is found, nothing loaded."""

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        return 0

    def load(self, block_hashes: Sequence[BlockHash], allocate: Allocate) -> list[BlockId]:
        assert not block_hashes, "NoPrefixSource holds nothing"
        return allocate(0)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, salt: bytes,
                 source: PrefixSource | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.salt = salt
        self.source: PrefixSource = source or NoPrefixSource()
        self.num_loaded_blocks = 0  # blocks the source filled on admission
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queues ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.update_block_hashes(self.cfg.block_size, self.salt)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Remove `req` from the queues and drop its block references (tail blocks first)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release_blocks(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow_or_preempt(req, n, preempted):
                break  # req itself was preempted: every later running request was too
            scheduled.append(req)
            counts.append(n)
            budget -= n
            i += 1

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.waiting[0]
            n = self._admit(req, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            scheduled.append(req)
            counts.append(n)
            budget -= n
        return ScheduledBatch(scheduled, counts, preempted)

    def update_computed(self, batch: ScheduledBatch) -> None:
        """After the forward pass: advance computed counts and publish newly full blocks."""
        bs = self.cfg.block_size
        for req, n in zip(batch.requests, batch.num_new_tokens):
            before = req.num_computed_tokens // bs
            req.num_computed_tokens += n
            after = req.num_computed_tokens // bs
            if after > before and not req.num_evicted_tokens:  # an evicted cache is no prefix
                self.pool.cache_full_blocks(req.block_ids[before:after], req.block_hashes[before:after],
                                            parent_hash=req.block_hashes[before - 1] if before else None)
            if self.cfg.sliding_window is not None:
                self._release_outside_window(req, self.cfg.sliding_window)

    # -- internals ------------------------------------------------------------------------
    def _blocks_needed(self, req: Request, n: int) -> int:
        total = -(-(req.num_computed_tokens - req.num_evicted_tokens + n) // self.cfg.block_size)
        return max(0, total - len(req.block_ids))

    def _grow_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> bool:
        need = self._blocks_needed(req, n)
        while True:
            try:
                req.block_ids.extend(self.pool.allocate(need))
                return True
            except OutOfBlocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    return False

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed_tokens = req.num_evicted_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _release_blocks(self, req: Request) -> None:
        held = req.held_block_ids
        if held:
            self.pool.free_sequence(held)
        req.block_ids = []

    def _release_outside_window(self, req: Request, window: int) -> None:
        """Free the blocks no future token can attend to: the next token, at position
        `num_computed_tokens`, sees positions > num_computed_tokens - window, so block j is
        dead once (j + 1) * block_size <= num_computed_tokens - window + 1. A generation
        then holds at most ceil(window / block_size) + 1 blocks. Freed blocks keep their
        cached hash (other requests may still share them) until the pool evicts them."""
        bs = self.cfg.block_size
        dead = min(max(0, req.num_computed_tokens - window + 1) // bs, len(req.block_ids))
        freed = [b for b in req.block_ids[:dead] if b != NO_BLOCK]
        if freed:
            self.pool.free(freed)
            req.block_ids[:dead] = [NO_BLOCK] * dead

    def _admit(self, req: Request, budget: int) -> int:
        """Take blocks for the waiting head; returns tokens scheduled (0: it does not fit now)."""
        bs = self.cfg.block_size
        # Keep at least the last token uncached: its logits are needed to sample.
        max_cached_blocks = (req.num_tokens - 1) // bs
        cached = self.pool.find_longest_prefix(req.block_hashes[:max_cached_blocks])
        num_loaded = self.source.match_prefix(req.block_hashes[len(cached):max_cached_blocks])
        num_computed = (len(cached) + num_loaded) * bs
        remaining = req.num_tokens - num_computed
        n = min(remaining, budget)
        if n < remaining and not self.cfg.enable_chunked_prefill:
            return 0
        need = -(-(num_computed + n) // bs) - len(cached)
        # Touching a cached block at ref 0 takes it off the free queue, so count those too.
        reused_free = sum(1 for b in cached if self.pool.ref_cnt(b) == 0)
        if need + reused_free > self.pool.num_free_blocks:
            return 0
        self.pool.touch(cached)
        loaded_hashes = req.block_hashes[len(cached):len(cached) + num_loaded]
        loaded = self.source.load(loaded_hashes, self.pool.allocate)
        if loaded:
            self.pool.cache_full_blocks(loaded, loaded_hashes,
                                        parent_hash=req.block_hashes[len(cached) - 1] if cached else None)
            self.num_loaded_blocks += len(loaded)
        req.block_ids = list(cached) + loaded + self.pool.allocate(need - num_loaded)
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = min(num_computed, req.num_prompt_tokens)
        return n
