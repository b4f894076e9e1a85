"""The router's shared-prefix hint on the worker (proto GenerateRequest.shared_prefix_blocks →
`Request.shared_prefix_blocks` → `KVStore.cache(shared=…)` → kvstore/pool.py): the hinted leading
blocks are protected from their first use, so traffic that follows evicts its own one-off blocks
before a new prefix that has served one request so far. The scheduler driven without a model;
the wire's check of the field beside it."""
from __future__ import annotations

import itertools

import pytest

from contracts.requests import BadRequest
from contracts.wire import to_generate_input
from kvstore.layout import KVLayout
from kvstore.store import KVStore
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from tests.support.scheduling import step_scheduler
from worker.engine.request import Request, RequestStatus
from worker.engine.sampling import SamplingParams
from worker.engine.scheduler import Scheduler, SchedulerConfig

BS = 16
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, kv_cache_dtype="fp32")
SALT = b"shared-prefix-hint-test"


def _served_prefix(hint: int) -> int:
    """Blocks of a 4-block prefix a second request finds after two cold requests passed by."""
    tokens = itertools.count(3000)
    prefix = [next(tokens) for _ in range(4 * BS)]
    s = Scheduler(SchedulerConfig(block_size=BS, max_num_batched_tokens=1024), KVStore(LAYOUT, 16, "cpu"), SALT)

    def run(rid: str, prompt: list[int], shared: int = 0) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=1), len(prompt) + 1, shared_prefix_blocks=shared)
        s.add(req)
        while req.status is not RequestStatus.FINISHED:
            step_scheduler(s, BS, SALT)
        return req

    run("first", prefix + [next(tokens) for _ in range(8)], shared=hint)   # 5 blocks, the prefix's 4 cached
    run("cold-1", [next(tokens) for _ in range(7 * BS)])                   # 8 blocks, freed after first's
    run("cold-2", [next(tokens) for _ in range(11 * BS)])                  # 12 of the 16: evicts 9 freed
    again = run("again", prefix + [next(tokens) for _ in range(8)])
    s.store.check_integrity(())
    return again.num_cached_tokens // BS


def test_a_hinted_prefix_outlives_the_one_off_blocks_freed_after_it() -> None:
    assert _served_prefix(hint=4) == 4
    assert _served_prefix(hint=0) == 0     # unhinted, its 4 blocks were the oldest freed: evicted first


def test_a_partial_hint_protects_that_many_leading_blocks() -> None:
    assert _served_prefix(hint=2) == 2


def test_the_wire_refuses_a_negative_hint_and_carries_a_good_one() -> None:
    msg = pb.GenerateRequest(request_id="r", text="hi", shared_prefix_blocks=-1)
    with pytest.raises(BadRequest, match="shared_prefix_blocks"):
        to_generate_input(msg)
    msg.shared_prefix_blocks = 7
    assert to_generate_input(pb.GenerateRequest.FromString(msg.SerializeToString())).shared_prefix_blocks == 7


def test_the_engine_protects_at_most_the_prompts_full_blocks(tiny_model_dir) -> None:
    """A hint past the prompt (a client talking to the worker directly) covers the prompt's full
    blocks only: the generated blocks cached after them stay unprotected."""
    import dataclasses

    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.request import prompt_input
    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=64,
                                 check_integrity=True, max_model_len=64))
    spec = dataclasses.replace(prompt_input(list(range(5, 23)), SamplingParams(max_tokens=7, ignore_eos=True)),
                               shared_prefix_blocks=1000)
    rid = engine.add_request(spec)                   # 18 tokens: 4 full blocks, then 7 generated
    assert engine.requests[rid].shared_prefix_blocks == 4
    while not any(out.finished for out in engine.step()):
        pass
    assert engine.store.pool.num_cached_blocks > 4   # the generated blocks were cached too
    assert engine.store.pool.num_reused_blocks == 4
