"""The router's shared-prefix hint (proto GenerateRequest.shared_prefix_blocks): how many leading
prompt blocks it expects other requests to share, from its block index's asks
(`BlockIndex.shared_prefix`); the worker's pool protects those from their first use.

The index's rule is checked as a function, then through a real RouterServer and a gRPC client:
what reaches the (fake) worker is the router's figure, whatever the client sent."""
from __future__ import annotations

import asyncio

import grpc

from kvstore.keys import BlockHash, block_hashes
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.index.asks import Ask, Reuse
from router.index.blocks import BlockIndex
from router.routing.types import WorkerId
from router.server import RouterServer
from tests.support.fake_worker import FakeWorker

BS = 4
W0 = WorkerId("w0")


def _prompt(prefix: int, suffix: int, prefix_blocks: int = 3, suffix_blocks: int = 2) -> list[BlockHash]:
    """A prompt's block hashes: `prefix_blocks` of system prompt `prefix`, then its own tail."""
    ids = [1000 * prefix + i for i in range(prefix_blocks * BS)]
    ids += [50_000 + 100 * suffix + i for i in range(suffix_blocks * BS)]
    return block_hashes(ids, BS, b"salt")


def _ask(index: BlockIndex, rid: str, hashes: list[BlockHash]) -> int:
    """What the router does per request: the hint, then the request's asks counted."""
    hint = index.shared_prefix(hashes)
    index.add_pending(rid, W0, hashes, expires_at=1e9)
    return hint


def test_a_fresh_index_hints_nothing() -> None:
    assert BlockIndex().shared_prefix(_prompt(0, 0)) == 0


def test_a_prefix_asked_before_is_shared_and_a_new_one_once_its_depths_are_reused() -> None:
    index = BlockIndex()
    index.set_capacity(5)      # the traffic clock: one pool-full per 5-block prompt
    assert _ask(index, "a", _prompt(0, 0)) == 0      # nothing known yet
    assert _ask(index, "b", _prompt(0, 1)) == 3      # the 3 blocks request a asked for too
    # depths 0-2 were asked again (1 of 1), depths 3-4 not yet (0 of 0 settled): a prefix nobody
    # asked for yet is expected to be shared over the reused depths only
    assert _ask(index, "c", _prompt(1, 2)) == 3
    # prefix 1, asked once a pool-full ago, is too young to count against depths 0-2 (over every
    # first ask they would read 1 of 2 and hint nothing) ...
    assert _ask(index, "d", _prompt(2, 3)) == 3
    assert _ask(index, "e", _prompt(3, 4)) == 3
    # ... until HINT_SETTLE (2) pool-fulls have passed since its ask: then 1 of 2, no more than half
    assert _ask(index, "f", _prompt(4, 5)) == 0
    # the blocks an earlier request asked for still count, depth rates or not
    assert _ask(index, "g", _prompt(1, 6)) == 3


def test_first_asks_settle_after_the_window_unless_asked_again() -> None:
    reuse = Reuse(settle=2.0)
    reuse.asked_first(BlockHash(1), 0, now=1.0)
    reuse.asked_first(BlockHash(2), 0, now=1.5)
    reuse.asked_again(BlockHash(1), Ask(1, 0, 1.0), now=2.0)      # young, asked again: settled now
    assert (reuse.first[0], reuse.again[0], reuse.settled[0], len(reuse)) == (2, 1, 1, 2)
    reuse.advance(3.0)                                             # block 1's window ends: not counted twice
    assert (reuse.settled[0], len(reuse)) == (1, 1)
    reuse.advance(3.5)                                             # block 2 settles, never asked again
    assert (reuse.first[0], reuse.again[0], reuse.settled[0], len(reuse)) == (2, 1, 2, 0)


def test_a_retry_of_the_same_request_is_not_its_own_evidence() -> None:
    index = BlockIndex()
    hashes = _prompt(0, 0)
    assert _ask(index, "a", hashes) == 0
    index.drop_pending("a")              # it failed before its prefill: its asks are forgotten
    assert index.shared_prefix(hashes) == 0


def test_the_router_sends_its_hint_and_ignores_the_clients() -> None:
    async def run() -> list[int]:
        fake = FakeWorker("w0")
        await fake.start()
        server = RouterServer(RouterConfig(worker_addresses=(fake.address,), http_port=None, health_interval_s=0.2))
        try:
            port, _ = await server.start()
            await server.wait_ready(10)
            server.registry.index = BlockIndex()        # fed, as with Redis: it counts the asks
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.RouterStub(ch)
                for suffix in (1, 2):                   # 12-token system prompt, then the request's own
                    ids = list(range(10, 22)) + [30 + suffix] * 8
                    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), shared_prefix_blocks=999,
                                             sampling=pb.SamplingParams(max_tokens=1))
                    async for _ in stub.Generate(req, timeout=10):
                        pass
                bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10, 11]), shared_prefix_blocks=-1)
                try:                                    # malformed, not ignored: refused, nothing sent
                    async for _ in stub.Generate(bad, timeout=10):
                        pass
                    raise AssertionError("a negative shared_prefix_blocks was accepted")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "shared_prefix_blocks" in (e.details() or "")
        finally:
            await server.stop(0)
            await fake.stop()
        return [r.shared_prefix_blocks for r in fake.requests]
    assert asyncio.run(run()) == [0, 3]
