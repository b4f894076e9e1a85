"""Hit predictions that correct themselves (router/routing/predictions.py): the running
average of a worker's over-prediction, the correction it triggers, and — through a real router,
redis-server and the real event classes — a worker that silently lost its blocks (it serves
cached_tokens=0 while the index says it holds the prompt) corrected within two requests: the
promised blocks leave the index, the worker's inventory replaces its entries, and the error
shows in `kvmesh:router_hit_prediction_error` and on `/v1/cluster`."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from contracts.tokenizer import ModelTokenizer
from contracts.wire import to_generate_input
from kvstore.keys import BlockHash
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.routing.predictions import Correction, HitPredictions, PredictionConfig
from router.routing.types import RouteRequest, WorkerId
from router.server import RouterServer
from tests.support.fake_worker import FakeWorker
from tests.support.redis_server import RedisServer

W = WorkerId("w0")
BS = 4


def _route(blocks: int) -> RouteRequest:
    return RouteRequest(tuple(range(blocks * BS + 1)), tuple(BlockHash(0x100 + i) for i in range(blocks)))


def test_a_persistent_over_prediction_is_corrected_a_passing_one_is_not() -> None:
    route = _route(8)                                   # 33 tokens, 8 blocks
    p = HitPredictions(PredictionConfig(ewma_weight=0.3, threshold=0.3))
    # one request served 2 blocks less than promised (a race with an eviction): never a correction
    for _ in range(20):
        seen = p.observe(W, route, 32, 24, BS)
        assert seen.correction is None and seen.error == pytest.approx(8 / 33)
    # served more than predicted (blocks stored after the pick): a negative error, no correction
    assert p.observe(W, route, 0, 32, BS) == (pytest.approx(-32 / 33), None)
    # nothing served of 8 promised blocks: the second such request corrects, naming the 8 blocks
    p = HitPredictions()
    assert p.observe(W, route, 32, 0, BS).correction is None
    seen = p.observe(W, route, 32, 0, BS)
    assert seen.correction == Correction(W, route.block_hashes[:8])
    assert p.shown(W).corrections == 1 and p.shown(W).mean_error > 0.4
    # the average starts again: a third miss alone does not correct; the promised blocks past
    # the ones served are the lost ones
    assert p.observe(W, route, 32, 0, BS).correction is None
    assert p.observe(W, route, 32, 8, BS).correction == Correction(W, route.block_hashes[2:8])
    assert p.shown(WorkerId("never")) == (0.0, 0)
    with pytest.raises(ValueError, match="threshold"):
        PredictionConfig(threshold=1.0)


async def _until(predicate: Any, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < timeout, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.02)


@pytest.mark.redis
def test_a_worker_that_silently_lost_its_blocks_is_corrected_within_two_requests(
        redis_server: RedisServer, tmp_path: Path) -> None:
    async def run() -> None:
        worker = FakeWorker("worker-a")                 # serves cached_tokens=0, whatever it holds
        await worker.start()
        files_dir = tmp_path / "tok"
        files_dir.mkdir()
        for name, data in worker.files.items():
            (files_dir / name).write_bytes(data)
        cfg = RouterConfig(redis_url=redis_server.url, http_port=0, health_interval_s=0.1, model="tiny")
        router = RouterServer(cfg, tokenizer=ModelTokenizer.from_model_dir(files_dir))
        _, http_port = await router.start()
        core = router.core
        index = core.registry.index
        wid = WorkerId(worker.worker_id)
        try:
            await asyncio.to_thread(worker.register, redis_server.url)
            worker.run_publisher()
            await router.wait_ready(5)

            def request() -> pb.GenerateRequest:
                return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2 + i % 12 for i in range(33)]),
                                          sampling=pb.SamplingParams(max_tokens=1, temperature=0.0))
            prompt = (await core.prepare(to_generate_input(request()))).route.block_hashes
            assert len(prompt) == 8
            await worker.store(list(prompt))            # the worker stores the prompt's 8 blocks...
            await _until(lambda: index.match_prefix(prompt, [wid], pending=False) == {wid: 8}, 5, "stored")
            other = [BlockHash(0xF00D)]
            worker.blocks[:] = other                    # ...and loses them without an event (holds another)
            errors = []
            for n in range(1, 3):
                prepared = await core.prepare(to_generate_input(request()))
                async for response in core.generate(prepared, 10):
                    assert response.cached_tokens == 0
                errors.append(core.predictions.shown(wid).mean_error)
                if n == 1:                              # one miss may be a race: no correction yet
                    assert index.match_prefix(prompt, [wid], pending=False) == {wid: 8}
            # the second miss corrects: the promised blocks leave the index at once, and the
            # inventory the router asked for replaces the worker's entries with what it holds
            assert core.predictions.shown(wid).corrections == 1
            assert index.match_prefix(prompt, [wid], pending=False) == {wid: 0}
            await _until(lambda: index.match_prefix(other, [wid], pending=False) == {wid: 1}, 5, "inventory")
            index.check_integrity()
            # the next request is predicted right: no error, no further correction
            prepared = await core.prepare(to_generate_input(request()))
            async for _ in core.generate(prepared, 10):
                pass
            assert core.stats.mismatches == 2 and core.predictions.shown(wid).corrections == 1
            assert errors[1] > errors[0] > 0.2
            samples = {s.name: s.value for m in router.metrics.registry.collect() for s in m.samples
                       if m.name == "kvmesh:router_hit_prediction_error" and s.labels.get("worker") == wid}
            assert samples["kvmesh:router_hit_prediction_error_count"] == 3
            assert samples["kvmesh:router_hit_prediction_error_sum"] == pytest.approx(2 * 32 / 33)
            async with aiohttp.ClientSession() as session:      # what the dashboard shows
                async with session.get(f"http://127.0.0.1:{http_port}/v1/cluster") as resp:
                    doc = await resp.json()
            assert doc["workers"][0]["hit_prediction"] == {"mean_error": pytest.approx(errors[1] * 0.7),
                                                           "corrections": 1}
        finally:
            await router.stop(0)
            await worker.stop()
    asyncio.run(run())
