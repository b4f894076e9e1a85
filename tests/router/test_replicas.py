"""Router replicas that share pending blocks (router/routing/replicas.py over
kvstore/metadata/pending.py) on a real redis-server: router A's attempt shows in router B's
index as pending blocks, its prefill queue and sustained load, B's request for the same prefix
waits for A's prefill, and A's DONE ends it (for a router that died: its missed heartbeats).
Without sharing B sees nothing of A's request (the gap `kvmesh bench routing-live --routers`
measures)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvstore.keys import BlockHash
from kvstore.metadata.pending import NoteKind, PendingLog, PendingNote
from kvstore.metadata.registry import RedisConfig
from router.index.compact import CompactBlockIndex
from router.routing.inflight import InFlightConfig, InFlightPrefills
from router.routing.replicas import SharedPending
from router.routing.types import RouteRequest, WorkerId
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.redis]

W0, W1 = WorkerId("w0"), WorkerId("w1")
ROUTE = RouteRequest(tuple(range(33)), tuple(BlockHash(0x500 + i) for i in range(8)))


async def _until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.01)


def test_a_note_survives_the_wire() -> None:
    note = PendingNote(NoteKind.SENT, "r1", "req-1", W0, ROUTE.block_hashes, 17)
    assert PendingNote.decode(note.encode()) == note
    done = PendingNote(NoteKind.DONE, "r1", "req-1", streamed=True)
    assert PendingNote.decode(done.encode()) == done
    with pytest.raises(ValueError, match="lacks"):
        PendingNote.decode({"kind": "sent"})


def test_one_routers_attempt_is_pending_in_the_others_index(redis_server: RedisServer) -> None:
    async def go() -> None:
        cfg = RedisConfig(url=redis_server.url, cluster_name="rep")
        made: list[tuple[InFlightPrefills, CompactBlockIndex, SharedPending]] = []
        for name in ("a", "b"):
            prefills, index = InFlightPrefills(InFlightConfig(pending_ttl_s=60.0)), CompactBlockIndex()
            shared = SharedPending(cfg, prefills, index, router_id=name)
            shared.start()
            made.append((prefills, index, shared))
        (pa, ia, sa), (pb_, ib, sb) = made
        try:
            await asyncio.sleep(0.2)                     # both readers at the stream's end
            pa.dispatched(ia, "req-1", W0, ROUTE, predicted_tokens=0)
            await _until(lambda: ib.match_prefix(ROUTE.block_hashes, [W0, W1]).get(W0) == 8,
                         "A's pending blocks in B's index")
            assert ib.match_prefix(ROUTE.block_hashes, [W0, W1], pending=False).get(W0, 0) == 0
            assert pb_.queued_tokens(ib, [W0, W1], RouteRequest((), ()))[W0] == 33
            assert pb_.mean_in_flight([W0])[W0] >= 0.0 and ib.computing(W0, ROUTE.block_hashes) == {"a/req-1"}
            # B's request for the same prefix on w0 waits for A's prefill there
            pb_.dispatched(ib, "req-2", W0, ROUTE, predicted_tokens=32)
            waiter = asyncio.create_task(pb_.wait_for_leaders("req-2", 10.0))
            await asyncio.sleep(0.2)
            assert not waiter.done()
            pa.prefilled(ia, "req-1")
            await asyncio.wait_for(waiter, 5.0)
            # and A sees B's attempt (no echo of its own)
            await _until(lambda: "b/req-2" in ia.pending_requests(), "B's attempt in A's index")
            assert not any(r.startswith("a/") for r in ia.pending_requests())
            pa.done(ia, "req-1", streamed=False)         # A's attempt failed before streaming
            await _until(lambda: "a/req-1" not in ib.pending_requests(), "A's DONE in B's index")
            assert pb_.queued_tokens(ib, [W0], RouteRequest((), ()))[W0] == 1    # B's own req-2 only
            assert (sa.log.bad_entries, sb.log.bad_entries) == (0, 0)
        finally:
            for _, _, shared in made:
                await shared.stop()

    asyncio.run(go())


def test_the_attempts_of_a_router_that_died_end_when_its_heartbeats_stop(redis_server: RedisServer) -> None:
    async def go() -> None:
        cfg = RedisConfig(url=redis_server.url, cluster_name="rep")
        prefills, index = InFlightPrefills(InFlightConfig(pending_ttl_s=60.0)), CompactBlockIndex()
        shared = SharedPending(cfg, prefills, index, router_id="b", alive_s=0.1, dead_after_s=1.0)
        shared.start()
        alive = SharedPending(cfg, InFlightPrefills(), CompactBlockIndex(), router_id="a", alive_s=0.1)
        alive.start()
        dead = PendingLog(cfg, "gone")
        other = RouteRequest((), (BlockHash(0x900),))
        try:
            await asyncio.sleep(0.2)
            await dead.publish([PendingNote(NoteKind.SENT, "gone", "req-9", W1, ROUTE.block_hashes, 33)])
            alive.prefills.dispatched(alive.index, "req-1", W0, other, predicted_tokens=0)
            await _until(lambda: {"gone/req-9", "a/req-1"} <= set(index.pending_requests()), "both attempts")
            assert prefills.queued_tokens(index, [W1], RouteRequest((), ()))[W1] == 33
            # B waits on the dead router's prefill only until its heartbeats are missed
            prefills.dispatched(index, "req-2", W1, ROUTE, predicted_tokens=32)
            t0 = time.monotonic()
            await asyncio.wait_for(prefills.wait_for_leaders("req-2", 30.0), 5.0)
            assert time.monotonic() - t0 < 2.0
            assert "gone/req-9" not in index.pending_requests()
            assert prefills.queued_tokens(index, [W1], RouteRequest((), ()))[W1] == 1
            await asyncio.sleep(1.2)                    # the live router's attempt stays
            assert "a/req-1" in index.pending_requests()
        finally:
            await dead.aclose()
            await alive.stop()
            await shared.stop()

    asyncio.run(go())


def test_share_pending_needs_a_redis() -> None:
    from router.config import RouterConfig
    with pytest.raises(ValueError, match="share_pending"):
        RouterConfig(share_pending=True)
    assert RouterConfig(share_pending=True, redis_url="redis://127.0.0.1:1/0").share_pending
