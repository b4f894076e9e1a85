"""A waiting request's cached prefix is evicted last (worker/engine/scheduler.py `Scheduler.add`,
kvstore/store.py `KVStore.refresh`): a cold request admitted ahead of it in the same step
allocates other free blocks first, so it finds the prefix the router's index listed when it was
sent (issue #39: the whole free prefix at the free queue's head was taken by such an admission,
and its request served 12 of 16 promised blocks). The scheduler driven without a model."""
from __future__ import annotations

import itertools

from kvstore.layout import KVLayout
from kvstore.store import KVStore
from tests.support.scheduling import step_scheduler
from worker.engine.request import Request, RequestStatus
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerConfig

BS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, kv_cache_dtype="fp32")
SALT = b"waiting-prefix-test"
_tokens = itertools.count(2000)
PREFIX = [next(_tokens) for _ in range(4 * BS)]


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), len(prompt) + 1)


def _run(s: Scheduler, req: Request) -> None:
    s.add(req)
    while req.status is not RequestStatus.FINISHED:
        step_scheduler(s, BS, SALT)


def test_a_waiting_requests_cached_prefix_survives_an_admission_ahead_of_it() -> None:
    s = Scheduler(SchedulerConfig(block_size=BS, max_num_batched_tokens=1024), KVStore(LAYOUT, 16, "cpu"), SALT)
    _run(s, _request("a", PREFIX + [next(_tokens) for _ in range(8)]))     # 5 blocks, the prefix's 4 cached
    _run(s, _request("f", [next(_tokens) for _ in range(170)]))            # the other 11, freed after a's
    # the free queue: a's blocks first (its prefix next to go), then f's; nothing empty
    cold = _request("cold", [next(_tokens) for _ in range(4 * BS)])          # allocates 5 blocks
    again = _request("again", PREFIX + [next(_tokens) for _ in range(8)])
    s.add(cold)
    s.add(again)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["cold", "again"]       # one step, cold first
    assert again.num_cached_tokens == 4 * BS        # without the refresh: 0 (cold's blocks were the prefix's)
    assert cold.num_cached_tokens == 0
    s.store.check_integrity(r.held_block_ids for r in s.running)
