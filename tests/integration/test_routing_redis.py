"""Redis goes away and comes back under a router and a real `kvmesh worker` (SmolLM2): routing goes on
from the last known index while Redis is down, and the index is rebuilt once it is back.

Its own redis-server and worker subprocess (no shared cluster); the in-process `RouterServer` and the
helpers are tests/integration/test_routing.py's. The oracles: block hashes computed here with
`kvstore.keys` against blocks the worker reports; the `cached_tokens` the worker reports against what
the router predicted from its index.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from contracts.tokenizer import ModelTokenizer
from kvstore.metadata.registry import RedisConfig, WorkerRegistry
from router.index.asks import cluster_fill
from tests.integration.test_routing import (
    INDEX_LAG_S,
    SYSTEM,
    SYSTEM_B,
    Spawned,
    _cached,
    _chat,
    _common_prefix,
    _expected_hit,
    _generate,
    _kill,
    _live,
    _prepare,
    _registered,
    _spawn_worker,
    _start_router,
    _until,
)
from tests.support.redis_server import REDIS_SERVER, RedisServer

pytestmark = [pytest.mark.multiproc, pytest.mark.redis]


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    """The tokenizer the in-process router uses (the same files the router would load)."""
    from worker.model.loader import resolve_model_dir
    return ModelTokenizer.from_model_dir(resolve_model_dir("smollm2", progress=False))


def test_redis_restart_resyncs_index(tokenizer: ModelTokenizer, tmp_path: Path) -> None:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    name = f"kvmesh-resync-{uuid.uuid4().hex[:8]}"
    rcfg = RedisConfig(url=server.url, cluster_name=name)
    solo: Spawned | None = None
    registry = WorkerRegistry(rcfg)
    try:
        solo = _spawn_worker(tmp_path, "w-solo", "--redis-url", server.url, "--cluster-name", name)

        async def main() -> None:
            router = await _start_router(tokenizer, redis_url=server.url, cluster_name=name)
            consumer = router.registry.consumer   # the EventConsumer: its `degraded` / stats say what it saw
            try:
                await router.wait_ready(15)
                info = router.core.model_info
                assert info is not None and _live(router) == {"w-solo"}
                bs = info.block_size
                a1 = await _prepare(router, _chat(SYSTEM, "Name a lake in Italy."))
                await _generate(router, a1)
                a_hashes = a1.route.block_hashes
                await _until(lambda: _cached(router, a_hashes, "w-solo") == len(a_hashes), INDEX_LAG_S,
                             "index shows w-solo holding the first prompt's blocks")

                server.stop()
                await _until(lambda: consumer.degraded, 5, "the router notices Redis is gone")  # type: ignore[attr-defined]
                # Routing goes on from the last known index.
                a2 = await _prepare(router, _chat(SYSTEM, "Name a volcano in Iceland."))
                shared = _common_prefix(a_hashes, a2.route.block_hashes)
                assert router.core.routing_state(a2.route).cached_blocks["w-solo"] == shared >= len(a_hashes) - 2
                routed0, mismatches0 = router.core.stats.routed_hit_tokens, router.core.stats.mismatches
                done = await _generate(router, a2)
                expected = _expected_hit(shared, len(a2.route.token_ids), bs)
                assert done.worker_id == "w-solo" and done.cached_tokens == expected > 0
                # Both prompts held the shared blocks: the index counts them shared on w-solo,
                # and the prompts' blocks in the cluster's one-copy fill of the pool.
                seen = router.core.routing_state(a2.route)
                assert seen.loads["w-solo"].shared_blocks >= shared
                assert 0 < seen.cluster_committed == pytest.approx(
                    cluster_fill(router.registry.index, seen.loads["w-solo"].num_blocks))
                assert (router.core.stats.routed_hit_tokens - routed0, router.core.stats.mismatches) == (
                    expected, mismatches0)
                # Blocks stored while Redis is down cannot reach the index yet.
                b = await _prepare(router, _chat(SYSTEM_B, "Which wind blows in the Bay of Biscay?"))
                await _generate(router, b)
                b_hashes = b.route.block_hashes
                assert _common_prefix(a_hashes, b_hashes) == 0
                await asyncio.sleep(0.3)
                assert _cached(router, b_hashes, "w-solo") == 0 and consumer.degraded  # type: ignore[attr-defined]

                server.start()      # same port, empty, a new run_id
                t_up = time.monotonic()
                registered = await _until(lambda: "w-solo" in _registered(registry), 6,
                                          "w-solo registered again in the new Redis")
                await _until(lambda: _cached(router, a_hashes, "w-solo") == len(a_hashes)
                             and _cached(router, b_hashes, "w-solo") == len(b_hashes), 10 - (time.monotonic() - t_up),
                             "index rebuilt: both prompts' blocks on w-solo (the second learned only now)")
                rebuilt = time.monotonic() - t_up
                assert not consumer.degraded and consumer.stats().redis_restarts == 1  # type: ignore[attr-defined]
                assert _live(router) == {"w-solo"}
                done = await _generate(router, await _prepare(router, _chat(SYSTEM_B, "Name a cape in Africa.")))
                assert done.cached_tokens > 0 and router.core.stats.mismatches == mismatches0
                print(f"after the restart: re-registered in {registered:.2f} s, index rebuilt in {rebuilt:.2f} s")
            finally:
                await router.stop(0)

        asyncio.run(main())
    finally:
        if solo is not None:
            _kill(solo.proc)
        registry.close()
        server.stop()
