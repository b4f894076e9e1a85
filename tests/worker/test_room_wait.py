"""Admissions that wait for room (`SchedulerConfig.room_wait_steps`): a waiting request whose
blocks would evict a shared prefix (protected, not stale) is put off while the running requests
hold at least as many blocks of their own, which finishing frees first; never with nothing
running, never past `room_wait_steps` steps. The scheduler driven without a model."""
from __future__ import annotations

import itertools

import pytest

from kvstore.layout import KVLayout
from kvstore.store import KVStore
from tests.support.scheduling import step_scheduler
from worker.engine.request import Request, RequestStatus
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerConfig

BS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, kv_cache_dtype="fp32")
SALT = b"room-wait-test"
POOL = 16
_tokens = itertools.count(5000)


def _tokens_n(n: int) -> list[int]:
    return [next(_tokens) for _ in range(n)]


class Cluster:
    """A 16-block pool holding an 8-block shared prefix, protected and free (a request hinted it
    shared and finished)."""

    def __init__(self, room_wait_steps: int) -> None:
        self.s = Scheduler(SchedulerConfig(block_size=BS, max_num_batched_tokens=1024, room_wait_steps=room_wait_steps),
                           KVStore(LAYOUT, POOL, "cpu"), SALT)
        self.prefix = _tokens_n(8 * BS)
        first = self.add("first", self.prefix + _tokens_n(8), max_tokens=1, shared=8)
        self.run_until(lambda: first.status is RequestStatus.FINISHED)

    def add(self, rid: str, prompt: list[int], max_tokens: int, shared: int = 0) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), len(prompt) + max_tokens,
                      shared_prefix_blocks=shared)
        self.s.add(req)
        return req

    def step(self) -> None:
        step_scheduler(self.s, BS, SALT)

    def run_until(self, done, limit: int = 200) -> int:
        for steps in range(limit):
            if done():
                return steps
            self.step()
        raise AssertionError("not done")

    def prefix_blocks(self) -> int:
        """Leading blocks of the shared prefix the device pool still caches."""
        return len(self.s.store.lookup(_hashes(self.prefix)).device)


def _hashes(tokens: list[int]):
    probe = Request("probe", tokens + [1], SamplingParams(max_tokens=1), len(tokens) + 2)
    probe.update_block_hashes(BS, SALT)
    return probe.block_hashes[:len(tokens) // BS]


def test_an_admission_that_would_evict_a_shared_prefix_waits_for_a_running_request_to_finish() -> None:
    c = Cluster(room_wait_steps=32)
    running = c.add("running", _tokens_n(60), max_tokens=4)      # 4 blocks of its own
    c.step()
    assert running.status is RequestStatus.RUNNING
    # 4 blocks are free besides the prefix's 8: a 6-block prompt would take 2 of the prefix's
    waiting = c.add("waiting", _tokens_n(6 * BS), max_tokens=1)
    c.step()
    assert waiting.status is RequestStatus.WAITING and waiting.num_room_waits == 1
    c.run_until(lambda: waiting.status is not RequestStatus.WAITING)
    assert running.status is RequestStatus.FINISHED            # admitted once the running one freed its blocks
    assert c.s.num_room_waits == waiting.num_room_waits >= 1
    assert c.prefix_blocks() == 8                               # the shared prefix was kept whole
    c.run_until(lambda: waiting.status is RequestStatus.FINISHED)


def test_without_waiting_the_same_admission_evicts_part_of_the_prefix() -> None:
    c = Cluster(room_wait_steps=0)
    c.add("running", _tokens_n(60), max_tokens=4)
    c.step()
    waiting = c.add("waiting", _tokens_n(6 * BS), max_tokens=1)
    c.step()
    assert waiting.status is not RequestStatus.WAITING and waiting.num_room_waits == 0
    assert c.prefix_blocks() < 8


def test_with_nothing_running_an_admission_takes_what_it_needs_at_once() -> None:
    c = Cluster(room_wait_steps=32)
    big = c.add("big", _tokens_n(12 * BS), max_tokens=1)       # only eviction can make room for it
    c.step()
    assert big.status is not RequestStatus.WAITING and big.num_room_waits == 0
    assert c.prefix_blocks() < 8


def test_no_wait_when_the_running_requests_could_not_free_enough() -> None:
    c = Cluster(room_wait_steps=32)
    c.add("running", _tokens_n(28), max_tokens=2)               # 2 blocks of its own
    c.step()
    # 6 free besides the prefix: 11 blocks would take 5 of the prefix's, more than the running one frees
    waiting = c.add("waiting", _tokens_n(11 * BS), max_tokens=1)
    c.step()
    assert waiting.status is not RequestStatus.WAITING and waiting.num_room_waits == 0


def test_the_wait_ends_after_room_wait_steps() -> None:
    c = Cluster(room_wait_steps=3)
    running = c.add("running", _tokens_n(50), max_tokens=12)   # 4 blocks of its own for 12 decode steps
    c.step()
    waiting = c.add("waiting", _tokens_n(6 * BS), max_tokens=1)
    steps = c.run_until(lambda: waiting.status is not RequestStatus.WAITING)
    assert waiting.num_room_waits == 3 and steps == 4
    assert running.status is RequestStatus.RUNNING                # it did not wait for the finish
    assert c.prefix_blocks() < 8


def test_room_wait_steps_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="room_wait_steps"):
        SchedulerConfig(room_wait_steps=-1)
