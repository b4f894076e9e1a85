"""The host tier behind the engine's KV pool: evicted prefixes come back from host memory
with the same output, and a 4x over-subscribed pool completes every request exactly as an
unconstrained one does (integrity checked after every step)."""
from __future__ import annotations

import random

import pytest

from kvstore.keys import block_hashes
from worker.engine.engine import Engine, EngineConfig
from worker.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model_dir, num_blocks: int, offload_gib: float = 0.0, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=4, num_blocks=num_blocks,
                               kv_offload_gib=offload_gib, check_integrity=True, max_model_len=64, **kw))


def test_evicted_prefix_is_onloaded_from_host(tiny_model_dir):
    d = tiny_model_dir("llama-gqa")
    eng = _engine(d, num_blocks=12, offload_gib=0.001)
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(24)]           # 6 full blocks
    first = eng.generate(shared + [7, 8], GREEDY)[0]
    # unrelated traffic evicts the shared prefix from the 12-block device pool
    for _ in range(3):
        eng.generate([rng.randrange(3, 200) for _ in range(30)], GREEDY)
    assert eng.store.pool.find_longest_prefix(block_hashes(shared, 4, eng.salt)) == []
    before = eng.stats().num_onloaded_blocks
    again = eng.generate(shared + [7, 8], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert eng.stats().num_onloaded_blocks - before == 6
    assert again.num_cached_tokens == 24
    assert eng.store.pool.num_used_blocks == 0


def test_oversubscribed_pool_equals_unconstrained(tiny_model_dir):
    d = tiny_model_dir("llama-gqa")
    rng = random.Random(1)
    system = [rng.randrange(3, 200) for _ in range(16)]
    prompts = [system + [rng.randrange(3, 200) for _ in range(rng.randrange(4, 20))] for _ in range(10)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    big = _engine(d, num_blocks=256)
    want = [o.token_ids for o in big.generate(prompts, params)]
    # ~10 sequences x ~12 blocks each need ~120 blocks; give the device 30 (4x over-subscribed)
    small = _engine(d, num_blocks=30, offload_gib=0.002)
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert got == want
    st = small.stats()
    assert st.num_preemptions > 0 and st.num_onloaded_blocks > 0 and st.num_host_blocks > 0
    assert small.store.pool.num_used_blocks == 0


def test_offload_needs_prefix_caching():
    with pytest.raises(ValueError, match="kv_offload_gib"):
        EngineConfig(kv_offload_gib=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gib"):
        EngineConfig(kv_offload_gib=-1.0)


@pytest.mark.redis
def test_redis_index_reflects_tiers(tiny_model_dir, redis_server):
    """A worker's evicted-to-host blocks show up in the router's index as Tier.HOST, the
    ones still in the pool as Tier.DEVICE (events published by the worker's metadata hook)."""
    import asyncio
    import time

    from kvstore.events import Tier, WorkerId
    from kvstore.metadata.registry import RedisConfig
    from kvstore.metadata.streams import EventConsumer
    from router.index.blocks import BlockIndex
    from worker.server.service import WorkerServerConfig, _Metadata

    eng = _engine(tiny_model_dir("llama-gqa"), num_blocks=12, offload_gib=0.001)
    cfg = WorkerServerConfig(worker_id="w-tier", redis_url=redis_server.url, cluster_name="tiers")
    meta = _Metadata(cfg, "127.0.0.1:1", eng)
    meta.heartbeater.start()
    rng = random.Random(2)
    first = [rng.randrange(3, 200) for _ in range(24)]
    second = [rng.randrange(3, 200) for _ in range(24)]
    eng.generate(first, GREEDY)
    eng.generate(second, GREEDY)         # evicts most of `first` to host
    meta.after_step()
    h_first, h_second = block_hashes(first, 4, eng.salt), block_hashes(second, 4, eng.salt)
    on_host = [h for h in h_first if h in eng.store.host]
    assert on_host and all(eng.store.pool.get_cached_block(h) is None for h in on_host)

    async def main() -> None:
        index = BlockIndex()
        consumer = EventConsumer(RedisConfig(redis_server.url, "tiers"), index, block_ms=20)
        try:
            deadline = time.monotonic() + 5
            while index.locate(h_second[0]) == {} or any(index.locate(h) == {} for h in on_host):
                assert time.monotonic() < deadline, "index never caught up"
                meta.after_step()
                await consumer.poll()
            w = WorkerId("w-tier")
            assert all(Tier.HOST in index.locate(h)[w] for h in on_host)
            assert Tier.DEVICE in index.locate(h_second[0])[w]
            assert all(Tier.DEVICE not in index.locate(h)[w] for h in on_host)
        finally:
            await consumer.aclose()

    try:
        asyncio.run(main())
    finally:
        meta.close()


def test_evictions_are_handed_to_the_publisher_before_the_forward_pass(tiny_model_dir):
    """`Engine.after_schedule` runs once a step is scheduled, before its forward: the blocks a
    new request's admission evicted reach the publisher then, not after seconds of prefill."""
    from kvstore.events import TieredEvent
    from kvstore.pool import BlockRemoved
    from worker.engine.request import prompt_input

    eng = _engine(tiny_model_dir("llama-gqa"), num_blocks=12)
    eng.store.set_event_recording(True)
    rng = random.Random(1)
    eng.generate([rng.randrange(3, 200) for _ in range(30)], GREEDY)   # fills the pool's cache
    eng.store.take_events()
    order: list[str] = []
    taken: list[TieredEvent] = []

    def hook() -> None:
        order.append("after_schedule")
        taken.extend(eng.store.take_events())

    execute = eng._execute

    def forward(batch):
        order.append("forward")
        return execute(batch)

    eng.after_schedule, eng._execute = hook, forward
    eng.add_request(prompt_input([rng.randrange(3, 200) for _ in range(30)], GREEDY))
    eng.step()
    assert order == ["after_schedule", "forward"]
    assert any(isinstance(t.event, BlockRemoved) for t in taken), taken   # the evictions of this admission
