"""A router that learns its workers only from the registry (no --worker), and the scale-down
drain: a worker that reports NOT_SERVING, deregisters or expires leaves routing and
its blocks leave the block index at once; one that serves again gets its blocks back through
an inventory. Real redis-server, real BlockIndex / EventConsumer / EventPublisher; the workers
are in-process fakes (tests/support/fake_worker.py) that write their records and events with
the real kvstore classes.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from contracts.tokenizer import ModelTokenizer
from kvstore.keys import BlockHash
from kvstore.metadata.registry import RedisConfig
from router.config import RouterConfig
from router.index.blocks import BlockIndex
from router.routing.types import RouteRequest
from router.server import RouterServer
from tests.support.fake_worker import FakeWorker
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

A_BLOCKS = [BlockHash(0xA0 + i) for i in range(4)]
B_BLOCKS = [BlockHash(0xB0 + i) for i in range(4)]
# A departure reaches the router within one registry refresh (1 s) + one consumer poll (0.1 s); slack
# for a loaded machine. A drain (NOT_SERVING) within one probe (0.1 s here).
LEAVE_S = 3.0


async def _until(predicate: Any, timeout: float, what: str) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < timeout, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.02)
    return loop.time() - start


def test_registry_only_router_follows_joins_drains_and_departures(
        redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    async def run() -> None:
        a, b = FakeWorker("worker-a", blocks=list(A_BLOCKS)), FakeWorker("worker-b", blocks=list(B_BLOCKS))
        await a.start()
        cfg = RouterConfig(redis_url=redis_server.url, http_port=None, health_interval_s=0.1, model="tiny")
        files_dir = tmp_path / "tok"
        files_dir.mkdir()
        for name, data in a.files.items():
            (files_dir / name).write_bytes(data)
        router = RouterServer(cfg, tokenizer=ModelTokenizer.from_model_dir(files_dir))
        await router.start()
        index = router.registry.index
        assert isinstance(index, BlockIndex)

        def live() -> list[str]:
            return sorted(w.info.worker_id for w in router.registry.live() if w.info is not None)

        def held(blocks: list[BlockHash]) -> dict[str, int]:
            return {w: n for w, n in index.match_prefix(blocks).items() if n}
        try:
            # no worker registered: the router runs and is not ready
            await asyncio.sleep(0.3)
            assert not router.core.serving and live() == []
            # workers register: they join, their inventories fill the index
            for w in (a, b):
                if w.server is None:
                    await w.start()
                await asyncio.to_thread(w.register, redis_server.url)
                w.run_publisher()
            await router.wait_ready(5)
            await _until(lambda: live() == ["worker-a", "worker-b"], 5, "both join")
            await _until(lambda: held(A_BLOCKS) == {"worker-a": 4} and held(B_BLOCKS) == {"worker-b": 4}, 5,
                         "both inventories in the index")
            route = RouteRequest(tuple(range(4 * 4 + 1)), tuple(A_BLOCKS))
            assert router.core.pick(route, set()).worker.address == a.address     # drawn by its prefix

            # A drains (NOT_SERVING, still registered): out of routing and of the index at once,
            # and blocks it stores while draining stay out
            await a.set_serving(False)
            took = await _until(lambda: "worker-a" not in live() and held(A_BLOCKS) == {}, LEAVE_S, "A drains")
            await a.store([BlockHash(0xA9)])
            await asyncio.sleep(0.5)
            assert held(A_BLOCKS) == {} and held([BlockHash(0xA9)]) == {}
            assert router.core.pick(route, set()).worker.address == b.address
            index.check_integrity()
            # A serves again: back in routing, its inventory (with the block stored meanwhile) restores it
            await a.set_serving(True)
            await _until(lambda: held(A_BLOCKS) == {"worker-a": 4} and held([BlockHash(0xA9)]) == {"worker-a": 1},
                         5, "A's inventory after it serves again")
            assert "worker-a" in live()

            # B deregisters (SIGTERM): leaves routing, the index and the worker set
            assert b.registry is not None
            await asyncio.to_thread(b.registry.deregister, b.worker_id)
            await _until(lambda: "worker-b" not in live() and held(B_BLOCKS) == {}, LEAVE_S, "B deregistered")
            await _until(lambda: b.address not in [w.address for w in router.registry._workers.values()], LEAVE_S,
                         "B's entry goes")
            # A's record expires (its liveness key gone, as after a missed TTL)
            keys = RedisConfig(url=redis_server.url).keys
            with redis_server.client() as r:
                r.delete(keys.alive(a.worker_id))
            await _until(lambda: live() == [] and held(A_BLOCKS) == {}, LEAVE_S, "A expired")
            await _until(lambda: not router.core.serving, 1, "not ready with no worker")
            index.check_integrity()
            assert took < LEAVE_S
        finally:
            await router.stop(0)
            for w in (a, b):
                await w.stop()
    asyncio.run(run())


def test_gated_index_drops_a_closed_workers_entries_until_reopened() -> None:
    from kvstore.events import EventType, WireEvent, WorkerId
    from router.index.gate import GatedIndex

    index = BlockIndex()
    gate = GatedIndex(index)
    a, b = WorkerId("a"), WorkerId("b")
    gate.apply(a, WireEvent(EventType.STORED, tuple(A_BLOCKS)))
    gate.apply(b, WireEvent(EventType.STORED, tuple(A_BLOCKS[:2])))
    index.add_pending("r1", a, B_BLOCKS, expires_at=1e12)
    gate.close(a)
    assert index.match_prefix(A_BLOCKS, ["a", "b"]) == {"a": 0, "b": 2}
    assert index.match_prefix(B_BLOCKS, ["a"]) == {"a": 0}              # its pending blocks went too
    gate.apply(a, WireEvent(EventType.STORED, (BlockHash(0xA9),)))       # stored while draining
    assert index.locate(BlockHash(0xA9)) == {} and gate.is_closed(a)
    assert gate.reopen(a) and not gate.reopen(a)                         # True once: ask for an inventory
    gate.apply(a, WireEvent(EventType.STORED, (BlockHash(0xA9),)))
    assert set(index.locate(BlockHash(0xA9))) == {a}
    index.check_integrity()
