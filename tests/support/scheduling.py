"""Driving a `Scheduler` without a model: one step as the engine takes it (the scheduled tokens
count as computed; a request whose prompt is done samples token 7 and finishes at its length)."""
from __future__ import annotations

from worker.engine.request import FinishReason, RequestStatus
from worker.engine.scheduler import ScheduledBatch, Scheduler


def step_scheduler(s: Scheduler, block_size: int, salt: bytes) -> ScheduledBatch:
    """One engine step on `s`, then the KV store's integrity check."""
    batch = s.schedule()
    s.update_computed(batch)
    for req in batch.requests:
        if req.status is RequestStatus.RUNNING and req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
            req.update_block_hashes(block_size, salt)
            if req.num_tokens >= req.max_total_tokens:
                s.finish(req, FinishReason.LENGTH)
    s.store.check_integrity(r.held_block_ids for r in s.running)
    return batch
