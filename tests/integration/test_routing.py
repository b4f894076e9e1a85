"""Routing across real processes: the Redis-fed block index, worker liveness, retries
(Redis restarts: test_routing_redis.py).

One module-scoped `LocalCluster` (redis-server, 2 `kvmesh worker` subprocesses on SmolLM2, a
router subprocess) serves most tests; each test runs its own in-process `RouterServer` on the
cluster's Redis so it can look at `router.registry.index` and `router.core.stats`. Extra workers (to kill)
are subprocesses started by the test itself. The oracles: block hashes computed here with
`kvstore.keys` (the router process) against blocks the worker processes report; the
`cached_tokens` each worker reports against what the router predicted from its index.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from contracts.tokenizer import ModelTokenizer
from contracts.wire import to_generate_input
from kvmesh.serve.local import LocalCluster, ServeConfig
from kvstore.keys import BlockHash, block_hashes
from kvstore.metadata.registry import MetadataUnavailable, RedisConfig, WorkerRegistry
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.index.blocks import BlockIndex
from router.routing.core import Prepared
from router.routing.errors import UpstreamError
from router.server import RouterServer

pytestmark = [pytest.mark.multiproc, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
WORKER_LINE = re.compile(r"^kvmesh worker (\S+) serving on (\S+):(\d+)$", re.M)
WORKER_START_S = 120.0
INDEX_LAG_S = 2.0          # a worker's stored blocks reach the router's index within this
TTL_SLACK_S = 2.0          # a killed worker leaves the registry within heartbeat_ttl_s + this
SYSTEM = ("You are the reference desk of a small public library. Answer questions about European "
          "geography, rivers, mountains and capitals in one short sentence, citing no sources. "
          "If a question is about anything else, say politely that the desk only covers geography. ") * 3
SYSTEM_B = ("Pretend to be a ship's navigator in the year 1820. Describe winds, currents, coastlines and "
            "harbours in plain words, and keep every answer under twenty words. ") * 3


# -- processes ----------------------------------------------------------------------------------
class Spawned(NamedTuple):
    proc: subprocess.Popen[bytes]
    address: str
    log: Path


def _spawn_worker(tmp_path: Path, worker_id: str, *flags: str) -> Spawned:
    """`kvmesh worker` subprocess on a free port (64 blocks); waits for its serving line."""
    out, log = tmp_path / f"{worker_id}.out", tmp_path / f"{worker_id}.log"
    argv = [sys.executable, "-m", "kvmesh.cli", "worker", "--port", "0", "--worker-id", worker_id,
            "--model", "smollm2", "--num-blocks", "64", *flags]
    with open(out, "wb") as fo, open(log, "wb") as fe:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + WORKER_START_S
    while (m := WORKER_LINE.search(out.read_text(errors="replace"))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            pytest.fail(f"worker {worker_id} did not start (rc {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    assert m.group(1) == worker_id
    return Spawned(proc, f"{m.group(2)}:{m.group(3)}", log)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    cfg = ServeConfig(workers=2, model="smollm2", grpc_port=0, http_port=0, engine_argv=("--num-blocks", "256"),
                      cluster_name=f"kvmesh-routing-{uuid.uuid4().hex[:8]}")
    c = LocalCluster(cfg)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    """One tokenizer shared by every in-process router (the same files the router would load)."""
    from worker.model.loader import resolve_model_dir
    return ModelTokenizer.from_model_dir(resolve_model_dir("smollm2", progress=False))


# -- the in-process router ------------------------------------------------------------------------
async def _start_router(tokenizer: ModelTokenizer, **cfg: object) -> RouterServer:
    router = RouterServer(RouterConfig(http_port=None, routing_policy="kv_aware", **cfg),  # type: ignore[arg-type]
                          tokenizer=tokenizer)
    await router.start()
    return router


def _chat(system: str, user: str, max_tokens: int = 6, ignore_eos: bool = False) -> pb.GenerateRequest:
    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                        ignore_eos=ignore_eos))
    req.chat.messages.add(role="system", content=system)
    req.chat.messages.add(role="user", content=user)
    return req


async def _prepare(router: RouterServer, req: pb.GenerateRequest) -> Prepared:
    return await router.core.prepare(to_generate_input(req))


async def _run(router: RouterServer, prepared: Prepared,
               timeout: float = 60.0) -> tuple[list[int], pb.GenerateResponse]:
    """Run one request to its end; returns every streamed token id and the final response."""
    ids: list[int] = []
    last = None
    async with contextlib.aclosing(router.core.generate(prepared, timeout)) as stream:
        async for r in stream:
            ids.extend(r.token_ids)
            last = r
    assert last is not None and last.finished, last
    return ids, last


async def _generate(router: RouterServer, prepared: Prepared, timeout: float = 60.0) -> pb.GenerateResponse:
    return (await _run(router, prepared, timeout))[1]


def _picks(router: RouterServer, prepared: Prepared) -> str | None:
    """The worker id the router's policy picks for `prepared` now (the policy is a pure function)."""
    chosen = router.core.policy.pick(router.core.live_workers(), prepared.route,
                                     router.core.routing_state(prepared.route))
    return None if chosen is None else chosen.worker_id


async def _prompt_for(router: RouterServer, worker_id: str, tag: str, **kw: object) -> Prepared:
    """A request that the router's policy sends to `worker_id`. The prompts differ in their
    first block: with no cached prefix the ring order of the first blocks decides."""
    for i in range(64):
        prepared = await _prepare(router, _chat(f"Session {tag}-{i}. {SYSTEM_B}", "Which harbour is closest?",
                                                **kw))  # type: ignore[arg-type]
        if _picks(router, prepared) == worker_id:
            return prepared
    raise AssertionError(f"no prompt of 64 is routed to {worker_id}")


async def _until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `pred` every 20 ms; returns the seconds it took, fails after `timeout`."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:.1f} s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def _cached(router: RouterServer, hashes: Sequence[BlockHash], worker_id: str) -> int:
    """Leading blocks the index has from `worker_id`'s own events (not the router's pending
    prediction)."""
    index = router.registry.index
    assert isinstance(index, BlockIndex), "the router runs no block index"
    return index.match_prefix(hashes, [worker_id], pending=False)[worker_id]


def _registered(registry: WorkerRegistry) -> set[str]:
    try:
        return {r.worker_id for r in registry.live_workers()}
    except MetadataUnavailable:   # a pooled connection that predates a Redis restart fails once
        return set()


def _live(router: RouterServer) -> set[str]:
    return {w.worker_id for w in router.core.live_workers()}


def _common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expected_hit(shared_blocks: int, prompt_len: int, block_size: int) -> int:
    """Tokens a worker finds cached: the shared full blocks, less any block holding the last
    prompt token (which is always recomputed)."""
    return min(shared_blocks, (prompt_len - 1) // block_size) * block_size


# -- 1. the index follows the workers' events; hashes agree across processes -----------------------
def test_index_follows_events_and_hashes_agree(cluster: LocalCluster, tokenizer: ModelTokenizer) -> None:
    async def main() -> None:
        router = await _start_router(tokenizer, redis_url=cluster.redis_url, cluster_name=cluster.cfg.cluster_name)
        try:
            await _until(lambda: _live(router) == {"worker-0", "worker-1"}, 30, "both workers ready")
            info = router.core.model_info
            assert info is not None
            bs, salt = info.block_size, bytes.fromhex(info.hash_salt_hex)
            first = await _prepare(router, _chat(SYSTEM, "What is the capital of Portugal?"))
            ids, hashes = list(first.route.token_ids), list(first.route.block_hashes)
            assert hashes == block_hashes(ids, bs, salt) and len(hashes) == len(ids) // bs >= 8

            stats0 = (router.core.stats.requests, router.core.stats.mismatches)
            done = await _generate(router, first)
            wid = done.worker_id
            other = ({"worker-0", "worker-1"} - {wid}).pop()
            assert done.prompt_tokens == len(ids) and done.cached_tokens == 0
            # The worker process stored these blocks under its own hashes: they must be ours.
            lag = await _until(lambda: _cached(router, hashes, wid) == len(hashes), INDEX_LAG_S,
                               f"index shows {wid} holding the {len(hashes)} prompt blocks")
            assert _cached(router, hashes, other) == 0
            assert (router.core.stats.requests, router.core.stats.mismatches) == (stats0[0] + 1, stats0[1])

            second = await _prepare(router, _chat(SYSTEM, "Which river flows through Vienna?"))
            shared = _common_prefix(hashes, second.route.block_hashes)
            assert shared >= len(hashes) - 2   # only the user turn differs
            expected = _expected_hit(shared, len(second.route.token_ids), bs)
            assert _picks(router, second) == wid
            routed0, mismatches0 = router.core.stats.routed_hit_tokens, router.core.stats.mismatches
            done2 = await _generate(router, second)
            assert done2.worker_id == wid
            assert done2.cached_tokens == expected > 0
            assert router.core.stats.routed_hit_tokens - routed0 == expected
            assert router.core.stats.mismatches == mismatches0 == 0
            print(f"index lag {lag * 1000:.0f} ms; {shared} shared blocks, {expected} tokens cached on {wid}")
        finally:
            await router.stop(0)

    asyncio.run(main())


# -- 2. a killed worker leaves the registry and routing in time -------------------------------------
def test_killed_worker_leaves_routing(cluster: LocalCluster, tokenizer: ModelTokenizer, tmp_path: Path) -> None:
    name, url = cluster.cfg.cluster_name, cluster.redis_url
    rcfg = RedisConfig(url=url, cluster_name=name)
    extra = _spawn_worker(tmp_path, "w-extra", "--redis-url", url, "--cluster-name", name)
    registry = WorkerRegistry(rcfg)
    try:
        async def main() -> None:
            router = await _start_router(tokenizer, redis_url=url, cluster_name=name)
            try:
                await _until(lambda: "w-extra" in _registered(registry), 10, "w-extra in the registry")
                await _until(lambda: _live(router) == {"worker-0", "worker-1", "w-extra"}, 15,
                             "the router lists w-extra (from the registry, not from its config)")
                doomed = await _prompt_for(router, "w-extra", "doomed")
                others = [await _prepare(router, _chat(f"Port {i}. {SYSTEM_B}", "Name a sea.")) for i in range(4)]

                extra.proc.send_signal(signal.SIGKILL)
                t_kill = time.monotonic()
                limit = rcfg.heartbeat_ttl_s + TTL_SLACK_S
                # The router drops it from its index on its next registry refresh after the TTL.
                router_limit = limit + rcfg.heartbeat_interval_s

                async def left(gone: Callable[[], bool]) -> float:
                    while not gone():
                        await asyncio.sleep(0.05)
                    return time.monotonic() - t_kill

                # Watch the registry and the router (workers and index) while the requests run.
                watches = [asyncio.create_task(left(lambda: "w-extra" not in _registered(registry))),
                           asyncio.create_task(left(lambda: "w-extra" not in _live(router)
                                                    and "w-extra" not in router.registry.index.workers()))]  # type: ignore[union-attr]
                finals = await asyncio.gather(*(_generate(router, p) for p in [doomed, *others]))
                assert {f.worker_id for f in finals} <= {"worker-0", "worker-1"}
                _, pending = await asyncio.wait(watches, timeout=max(0.0, router_limit - (time.monotonic() - t_kill)))
                for task in pending:
                    task.cancel()
                assert not pending, f"w-extra still listed {router_limit:.1f} s after SIGKILL " \
                                    f"(registry: {watches[0] in pending}, router: {watches[1] in pending})"
                in_registry, in_router = (w.result() for w in watches)
                assert in_registry <= limit and in_router <= router_limit, (in_registry, in_router)
                after = [await _prepare(router, _chat(f"Cape {i}. {SYSTEM_B}", "Name a wind.")) for i in range(4)]
                finals = await asyncio.gather(*(_generate(router, p) for p in after))
                assert {f.worker_id for f in finals} <= {"worker-0", "worker-1"}
                print(f"w-extra left the registry {in_registry:.2f} s and the router {in_router:.2f} s after SIGKILL")
            finally:
                await router.stop(0)

        asyncio.run(main())
    finally:
        _kill(extra.proc)
        registry.close()


# -- 3. retry before the first token; a mid-stream failure is UNAVAILABLE ------------------------------
def test_retry_before_first_token_and_unavailable_mid_stream(cluster: LocalCluster, tokenizer: ModelTokenizer,
                                                              tmp_path: Path) -> None:
    victim = _spawn_worker(tmp_path, "w-victim")      # no Redis: the routers know it from their config
    addresses = (victim.address, *cluster.worker_addresses)
    try:
        async def main() -> None:
            # Probed once at start, then not again for an hour: they go on believing what they saw.
            # No migration: this test is about the error path (migration: tests/integration/test_chaos.py).
            mid = await _start_router(tokenizer, worker_addresses=addresses, health_interval_s=3600.0,
                                      migration_limit=0)
            stale = await _start_router(tokenizer, worker_addresses=addresses, health_interval_s=3600.0,
                                        migration_limit=0)
            try:
                for router in (mid, stale):
                    assert _live(router) == {"w-victim", "worker-0", "worker-1"}
                # fits the context
                long_req = await _prompt_for(mid, "w-victim", "long", max_tokens=800, ignore_eos=True)
                retried = await _prompt_for(stale, "w-victim", "retried")

                async def stream_then_kill() -> None:
                    async with contextlib.aclosing(mid.core.generate(long_req, 120)) as stream:
                        async for r in stream:
                            assert r.worker_id == "w-victim" and not r.finished
                            if victim.proc.poll() is None:
                                victim.proc.send_signal(signal.SIGKILL)   # after the first token
                    raise AssertionError("the stream ended without an error")

                with pytest.raises(UpstreamError) as err:
                    await asyncio.wait_for(stream_then_kill(), 30)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
                assert "w-victim" not in _live(mid)

                assert "w-victim" in _live(stale) and _picks(stale, retried) == "w-victim"
                ids, done = await asyncio.wait_for(_run(stale, retried), 60)
                assert done.worker_id in ("worker-0", "worker-1") and done.completion_tokens == len(ids) >= 1
                assert "w-victim" not in _live(stale)   # marked down by the failed attempt
                # The retried stream is a clean one: the same request again gives the same tokens.
                again = pb.GenerateRequest()
                again.CopyFrom(retried.request)
                again.request_id = f"again-{uuid.uuid4().hex}"
                assert (await _run(stale, Prepared(again, retried.route)))[0] == ids
            finally:
                await mid.stop(0)
                await stale.stop(0)

        asyncio.run(main())
    finally:
        _kill(victim.proc)
