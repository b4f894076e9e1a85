"""Continuous batching over the block pool (the vLLM v1 unified token view).

Every request has `num_tokens` (prompt + output) and `num_computed_tokens` (K/V in the
cache). A step schedules, per request, the next `num_tokens - num_computed_tokens` tokens
under a token budget: a whole or chunked prefill, or one decode token; `step_prefill_tokens`,
when set, caps a step's prefill tokens (all but a running request's single next token) apart,
so a step that decodes never carries a long chunk (a decode-role worker). Running requests go
first; when blocks run out the most recently admitted running request is preempted (its
blocks freed, recomputed later — its own full blocks usually still sit in the prefix cache).
Waiting requests are admitted in (priority, arrival) order — lower priority value first,
as the proto says — while budget, sequence slots and blocks allow, after one store lookup
(device pool, then host tier) that sets `num_cached_tokens`. Priority orders admission only:
the preemption victim is still the most recently admitted running request.

In-flight prefix dedupe: a waiting request whose next uncached full block is one a running
request is computing (two requests of one new prefix arriving together) is not admitted
that step; later waiting requests may be. Once the block is cached it is admitted with the
hit, so a shared prefix is computed once — the worker side of the router's pending blocks.

Tenants (`Request.tenant`, from the router): while two or more share the worker (or the router
marked a request here as shared: another tenant was busy at the router), a step's prefill goes
to the tenant with the lowest virtual token counter first and is capped at `fair_step_tokens`
(`ROUTER_STEP_FACTOR` times that with one tenant here), and a request of that tenant whose
prefill fits in the step runs in a light step without the other tenants' prefill
(worker.engine.fairness); decode tokens and the order within a tenant are as above. Blocks a
tenant caches count against its cap (kvstore.quota).

All block bookkeeping goes through the worker's `kvstore.store.KVStore`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.errors import OutOfBlocks
from kvstore.keys import BlockHash
from kvstore.store import KVStore
from worker.engine.fairness import ROUTER_STEP_FACTOR, Contention, FairShare
from worker.engine.request import NO_BLOCK, FinishReason, Request, RequestStatus
from worker.engine.room import waits_for_room
from worker.engine.waiting import WaitingQueue

_WAITS_FOR_PREFIX = -1   # `Scheduler._admit`: put off, another request computes its next block
_WAITS_FOR_DISK = -2     # `Scheduler._admit`: put off, its prefix is being read back from disk


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    sliding_window: int | None = None   # the model's: blocks wholly outside it are released
    enable_prefix_caching: bool = True  # False: nothing is cached, so no admission waits for a block
    fair_share: bool = True             # tenants share prefill by weight (worker.engine.fairness)
    fair_step_tokens: int = 16          # prefill tokens per step while tenants contend
    tenant_max_cached_frac: float = 0.5  # a tenant's cap on cached blocks without max_cached_blocks
    step_prefill_tokens: int = 0        # prefill tokens per step beside the decodes (0: the whole budget)
    room_wait_steps: int = 32           # steps an admission may wait to keep a shared prefix (0: never waits)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "fair_step_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")
        if not 0 < self.tenant_max_cached_frac <= 1:
            raise ValueError(f"tenant_max_cached_frac={self.tenant_max_cached_frac} must be in (0, 1]")
        if self.step_prefill_tokens < 0:
            raise ValueError(f"step_prefill_tokens={self.step_prefill_tokens} must be >= 0 (0: no cap)")
        if self.room_wait_steps < 0:
            raise ValueError(f"room_wait_steps={self.room_wait_steps} must be >= 0 (0: admissions never wait)")


class ScheduledBatch(NamedTuple):
    requests: list[Request]
    num_new_tokens: list[int]
    preempted: list[Request]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, store: KVStore, salt: bytes) -> None:
        self.cfg = cfg
        self.store = store
        self.salt = salt
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_waits = 0   # admissions put off for a block another request computes
        self.num_room_waits = 0     # admission steps put off to keep a shared prefix (worker.engine.room)
        self.fair = FairShare() if cfg.fair_share else None

    # -- queues ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.update_block_hashes(self.cfg.block_size, self.salt)
        if self.cfg.enable_prefix_caching and not req.needs_prompt_logits:
            # its cached prefix is evicted last while it waits: the admissions ahead of it (in this
            # step too) take other free blocks first, so it finds what the router's index listed
            self.store.refresh(req.block_hashes[:(req.num_tokens - 1) // self.cfg.block_size])
        if req.tenant.name:
            default = max(1, int(self.cfg.tenant_max_cached_frac * self.store.num_blocks))
            cap = req.tenant.max_cached_blocks
            self.store.set_owner_cap(req.tenant.name, default if cap is None else cap)
        if self.fair is not None:
            self.fair.arrive(req.tenant.name, req.tenant.weight, shared=req.tenant.shared)
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Remove `req` from the queues and drop its block references (tail blocks first)."""
        if self.fair is not None and req.status is not RequestStatus.FINISHED:
            self.fair.leave(req.tenant.name, req.tenant.shared)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release_blocks(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.store.poll_disk()   # prefixes read back from disk join the host tier before lookups
        contention = self.fair.contention() if self.fair is not None else Contention.NONE
        fair = self.fair if contention is not Contention.NONE else None
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []
        deferred: list[Request] = []   # contended: running prefill chunks, handed out by `_schedule_fair`
        # every token but a running request's single next one is prefill: capped per step (chunks need chunking)
        prefill = (self.cfg.step_prefill_tokens if self.cfg.step_prefill_tokens and self.cfg.enable_chunked_prefill
                   else budget)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget) if left == 1 else min(left, budget, prefill)
            if fair is not None and left > 1:
                deferred.append(req)
            elif n <= 0:
                pass   # this step's prefill tokens are spent: its next chunk runs in a later step
            elif not self._grow_or_preempt(req, n, preempted, scheduled):
                break  # req itself was preempted: every later running request was too
            else:
                scheduled.append(req)
                counts.append(n)
                budget -= n
                prefill -= n if left > 1 else 0
            i += 1
        if fair is not None:
            step = self.cfg.fair_step_tokens * (1 if contention is Contention.LOCAL else ROUTER_STEP_FACTOR)
            self._schedule_fair(fair, min(budget, step, prefill), deferred, scheduled, counts, preempted)
            return ScheduledBatch(scheduled, counts, preempted)

        computing = self._computing_hashes() if self.waiting and not preempted else set()
        for req in list(self.waiting):
            if min(budget, prefill) <= 0 or preempted or len(self.running) >= self.cfg.max_num_seqs:
                break
            n = self._admit(req, min(budget, prefill), computing)
            if n == _WAITS_FOR_PREFIX:
                self.num_prefix_waits += 1
                continue
            if n == _WAITS_FOR_DISK:
                continue
            if n == 0:
                break
            self._start(req, computing)
            scheduled.append(req)
            counts.append(n)
            budget -= n
            prefill -= n
        if self.fair is not None:
            for req, n in zip(scheduled, counts):
                self.fair.charge(req.tenant.name, n)
        return ScheduledBatch(scheduled, counts, preempted)

    def _schedule_fair(self, fair: FairShare, budget: int, deferred: list[Request], scheduled: list[Request],
                       counts: list[int], preempted: list[Request]) -> None:
        """The contended step (worker.engine.fairness): decode tokens are in `scheduled`
        already; `budget` prefill tokens go, a chunk at a time, to the tenant with the lowest
        virtual counter — its running prefills (`deferred`) first, then its waiting requests in
        (priority, arrival) order. A tenant whose next request does not fit waits for the next step.
        When the first request served starts and finishes its prefill here, the other tenants
        get no prefill in this step (`FairShare.light_step`)."""
        for req, n in zip(scheduled, counts):
            fair.charge(req.tenant.name, n)
        queues: dict[str, list[Request]] = {}
        for req in [*deferred, *self.waiting]:
            queues.setdefault(req.tenant.name, []).append(req)
        computing = self._computing_hashes() if self.waiting and not preempted else set()
        first = True
        while budget > 0 and queues:
            tenant = min(queues, key=fair.rank)
            req = queues[tenant].pop(0)
            if not queues[tenant]:
                del queues[tenant]
            if req.status is RequestStatus.RUNNING:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self._grow_or_preempt(req, n, preempted, scheduled):
                    continue
            else:
                if preempted or len(self.running) >= self.cfg.max_num_seqs:
                    continue
                n = self._admit(req, budget, computing)
                self.num_prefix_waits += n == _WAITS_FOR_PREFIX
                if n == 0:
                    queues.pop(tenant, None)
                if n <= 0:
                    continue
                self._start(req, computing)
                if first and req.num_computed_tokens + n >= req.num_tokens and any(t != tenant for t in queues):
                    fair.light_step()   # only this tenant prefills in this step
                    queues = {tenant: queues[tenant]} if tenant in queues else {}
            first = False
            scheduled.append(req)
            counts.append(n)
            budget -= n
            fair.charge(tenant, n)

    def _start(self, req: Request, computing: set[BlockHash]) -> None:
        """A waiting request that `_admit` gave blocks joins the running ones."""
        self.waiting.remove(req)
        self._note_computing(req, computing)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)
        req.status = RequestStatus.RUNNING

    def update_computed(self, batch: ScheduledBatch) -> None:
        """After the forward pass: advance computed counts and publish newly full blocks."""
        bs = self.cfg.block_size
        for req, n in zip(batch.requests, batch.num_new_tokens):
            before = req.num_computed_tokens // bs
            req.num_computed_tokens += n
            after = req.num_computed_tokens // bs
            if after > before and not req.num_evicted_tokens:  # an evicted cache is no prefix
                self.store.cache(req.block_ids[before:after], req.block_hashes[before:after],
                                 parent_hash=req.block_hashes[before - 1] if before else None,
                                 salt_root=req.hash_root, owner=req.tenant.name or None,
                                 shared=req.shared_prefix_blocks - before)
            if self.cfg.sliding_window is not None:
                self._release_outside_window(req, self.cfg.sliding_window)

    # -- internals ------------------------------------------------------------------------
    def _blocks_needed(self, req: Request, n: int) -> int:
        total = -(-(req.num_computed_tokens - req.num_evicted_tokens + n) // self.cfg.block_size)
        return max(0, total - len(req.block_ids))

    def _grow_or_preempt(self, req: Request, n: int, preempted: list[Request], scheduled: list[Request]) -> bool:
        """Blocks for `n` more tokens of running `req`, preempting the most recently admitted
        running request not in `scheduled` until they fit; False if `req` itself was preempted."""
        need = self._blocks_needed(req, n)
        while True:
            try:
                self._copy_shared_tail(req)
                req.block_ids.extend(self.store.allocate(need))
                return True
            except OutOfBlocks:
                victim = next((r for r in reversed(self.running) if r is req or r not in scheduled), req)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    return False

    def _copy_shared_tail(self, req: Request) -> None:
        """Copy-on-write: the block the next token's K/V goes into, if another sequence of
        the same fork still references it, becomes a private copy (the last writer keeps the
        original). Only a fork's partial block can be shared and written."""
        at = (req.num_computed_tokens - req.num_evicted_tokens) // self.cfg.block_size
        if at < len(req.block_ids) and req.block_ids[at] != NO_BLOCK and self.store.is_shared(req.block_ids[at]):
            req.block_ids[at] = self.store.copy_on_write(req.block_ids[at])

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Running sequences that continue `parent`'s computed prompt (n / best_of): each
        holds one more reference to every block of it; none is copied until written."""
        for child in children:
            self.store.share(parent.held_block_ids)
            child.block_ids = list(parent.block_ids)
            child.block_hashes = list(parent.block_hashes)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_evicted_tokens = parent.num_evicted_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            child.status = RequestStatus.RUNNING
            child.tenant = parent.tenant
            if self.fair is not None:
                self.fair.arrive(child.tenant.name, child.tenant.weight, shared=child.tenant.shared)
            self.running.append(child)
        parent.forked = True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed_tokens = req.num_evicted_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.add(req)
        self.num_preemptions += 1

    def _release_blocks(self, req: Request) -> None:
        held = req.held_block_ids
        if held:
            self.store.free_sequence(held)
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
            self.store.free(freed)
            req.block_ids[:dead] = [NO_BLOCK] * dead

    def _computing_hashes(self) -> set[BlockHash]:
        """The full blocks running requests are computing and will cache."""
        computing: set[BlockHash] = set()
        for req in self.running:
            self._note_computing(req, computing)
        return computing

    def _note_computing(self, req: Request, computing: set[BlockHash]) -> None:
        if req.num_evicted_tokens or not self.cfg.enable_prefix_caching:   # then it caches nothing
            return
        computing.update(req.block_hashes[req.num_computed_tokens // self.cfg.block_size:])

    def _admit(self, req: Request, budget: int, computing: set[BlockHash] | None = None) -> int:
        """Take blocks for a waiting request; returns tokens scheduled (0: it does not fit
        now; `_WAITS_FOR_PREFIX`: the next block it would compute is one a running request is
        computing (`computing`), so it waits for that block to be cached instead of computing
        it again — the in-flight prefix dedupe the router's pending blocks count on)."""
        bs = self.cfg.block_size
        # Keep at least the last token uncached: its logits are needed to sample.
        max_cached_blocks = (req.num_tokens - 1) // bs
        # prompt logprobs need the logits of every prompt position: no cache hit for those
        hashes = req.block_hashes[:max_cached_blocks] if not req.needs_prompt_logits else []
        match = self.store.lookup(hashes, req.hash_root)
        if match.num_disk and self.store.read_ahead(
                hashes[match.num_blocks:match.num_blocks + match.num_disk], req.hash_root):
            return _WAITS_FOR_DISK
        if computing and match.num_blocks < len(hashes) and hashes[match.num_blocks] in computing:
            return _WAITS_FOR_PREFIX
        num_computed = match.num_blocks * bs
        remaining = req.num_tokens - num_computed
        n = min(remaining, budget)
        if n < remaining and not self.cfg.enable_chunked_prefill:
            return 0
        need = -(-(req.max_total_tokens if n == remaining else num_computed + n) // bs)
        if waits_for_room(req, self.running, self.store.pool, match, need, bs, self.cfg.room_wait_steps):
            req.num_room_waits += 1
            self.num_room_waits += 1
            return 0
        try:
            req.block_ids = self.store.take(hashes, match, -(-(num_computed + n) // bs), req.tenant.name or None)
        except OutOfBlocks:
            return 0
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = min(num_computed, req.num_prompt_tokens)
        return n
