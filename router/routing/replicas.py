"""Router replicas that predict as one: each router's attempts, shared through Redis.

Two or three routers behind one Service each see a share of the requests. Each records the
blocks of its own requests as pending on the chosen worker (router/routing/inflight.py), so a
request for a prefix that another replica has just sent elsewhere finds no pending blocks, goes
to a worker that computes the prefix again, and the replica's prediction of the hit on that
worker misses what the worker serves. `SharedPending` (on with `--share-pending`) writes this
router's attempts to the cluster's pending stream (kvstore/metadata/pending.py) and enters the
other routers' attempts into its own `InFlightPrefills` (`joined`), so every replica's index
holds every replica's pending blocks, prefill queues and in-flight load, and a request waits
for another replica's request computing its prefix on the same worker as it would for its own.

Notes are queued by the listener calls (sync, on the router's loop) and written by one task
after `flush_s` in a pipeline; another task reads the others' notes (blocking at most
`block_ms`). Every router writes an ALIVE note each `alive_s`; the attempts of a router not
heard from for `dead_after_s` are ended (it died: its requests are gone, and a request of this
router waiting for one of them to prefill stops waiting), and any attempt whose DONE never
comes after `InFlightConfig.pending_ttl_s`. Redis errors are logged and retried; nothing here
fails a request. The prediction gap this closes is measured by `kvmesh bench routing-live --routers N`.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from kvstore.events import WorkerId
from kvstore.metadata.pending import NoteKind, PendingLog, PendingNote
from kvstore.metadata.registry import MetadataError, RedisConfig
from router.index.blocks import BlockIndex
from router.routing.inflight import InFlightPrefills
from router.routing.types import RouteRequest

log = logging.getLogger("kvmesh.router")

_RETRY_S = 1.0


class SharedPending:
    """One router's share (a `PrefillListener` of its `prefills`). `start` on the router's loop
    once the index exists; `stop` when the router stops."""

    def __init__(self, redis: RedisConfig, prefills: InFlightPrefills, index: BlockIndex,
                 router_id: str | None = None, flush_s: float = 0.002, alive_s: float = 0.5,
                 dead_after_s: float = 2.0) -> None:
        if not 0 < alive_s < dead_after_s:
            raise ValueError(f"alive_s={alive_s!r} must be > 0 and < dead_after_s={dead_after_s!r}")
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.log = PendingLog(redis, self.router_id)
        self.prefills, self.index = prefills, index
        self.flush_s, self.alive_s, self.dead_after_s = flush_s, alive_s, dead_after_s
        self._heard: dict[str, float] = {}      # router id → when it was last heard from
        self._out: list[PendingNote] = []
        self._wake = asyncio.Event()
        self._remote: dict[str, tuple[str, float]] = {}   # joined request id → (its router, when it is ended)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.applied = 0

    def start(self) -> None:
        self.prefills.listener = self
        self._tasks = [asyncio.create_task(self._write_loop(), name="pending-out"),
                       asyncio.create_task(self._read_loop(), name="pending-in"),
                       asyncio.create_task(self._alive_loop(), name="pending-alive")]

    async def stop(self) -> None:
        if self.prefills.listener is self:
            self.prefills.listener = None
        self._stopping = True     # a loop whose cancellation a Redis call turned into an error ends too
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_RETRY_S + 5.0)
        self._tasks = []
        await self.log.aclose()

    # -- this router's attempts (PrefillListener) ----------------------------------------------
    def sent(self, request_id: str, worker_id: WorkerId, route: RouteRequest, queued_tokens: int) -> None:
        self._note(PendingNote(NoteKind.SENT, self.router_id, request_id, worker_id, route.block_hashes,
                               queued_tokens))

    def prefilled(self, request_id: str) -> None:
        self._note(PendingNote(NoteKind.PREFILLED, self.router_id, request_id))

    def done(self, request_id: str, streamed: bool) -> None:
        self._note(PendingNote(NoteKind.DONE, self.router_id, request_id, streamed=streamed))

    def _note(self, note: PendingNote) -> None:
        self._out.append(note)
        self._wake.set()

    # -- the other routers' ------------------------------------------------------------------
    def apply(self, notes: list[PendingNote]) -> None:
        """Enter other routers' notes into this router's prefills and index."""
        now = time.monotonic()
        for note in notes:
            self._heard[note.router_id] = now
            rid = f"{note.router_id}/{note.request_id}"
            if note.kind is NoteKind.SENT:
                self.prefills.joined(self.index, rid, note.worker_id, RouteRequest((), note.hashes),
                                     note.queued_tokens)
                self._remote[rid] = (note.router_id, now + self.prefills.cfg.pending_ttl_s)
            elif note.kind is NoteKind.PREFILLED:
                self.prefills.prefilled(self.index, rid)
            elif note.kind is NoteKind.DONE and rid in self._remote:
                del self._remote[rid]
                self.prefills.done(self.index, rid, note.streamed)
            self.applied += 1
        dead = {r for r, t in self._heard.items() if t + self.dead_after_s <= now}
        for router in dead:
            del self._heard[router]
            log.warning("kvmesh router: router %s was not heard from for %.1f s; its requests in flight end "
                        "here", router, self.dead_after_s)
        for rid in [r for r, (router, t) in self._remote.items() if router in dead or t <= now]:
            del self._remote[rid]       # its router is gone or its notes were lost
            self.prefills.done(self.index, rid, streamed=False)

    async def _write_loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            await asyncio.sleep(self.flush_s)       # a burst of attempts in one round trip
            self._wake.clear()
            notes, self._out = self._out, []
            try:
                await self.log.publish(notes)
            except MetadataError as e:
                log.warning("kvmesh router: cannot share %d pending notes: %s", len(notes), e)
                await asyncio.sleep(_RETRY_S)

    async def _alive_loop(self) -> None:
        while not self._stopping:
            self._note(PendingNote(NoteKind.ALIVE, self.router_id, ""))
            await asyncio.sleep(self.alive_s)

    async def _read_loop(self) -> None:
        while not self._stopping:
            try:
                notes = await self.log.read()
            except MetadataError as e:
                log.warning("kvmesh router: cannot read other routers' pending notes: %s", e)
                await asyncio.sleep(_RETRY_S)
                continue
            self.apply(notes)
