"""The router's worker registry: one gRPC channel per worker address, health/load probes,
and — with a metadata Redis — the live-worker registry and the block index fed by the
workers' KV event streams.

Owned by the router core (router/routing/core.py), which reads `live()`, `entry()` and `index`
and calls `mark_down`; everything here runs on the router's event loop. A worker serves
once a probe finds it SERVING with a model that agrees with the others on block hashing
(hash_salt_hex, block_size, vocab_size) and on the tokenizer (tokenizer_sha256); one that
disagrees is refused for good.

A worker leaves routing — and its blocks the block index, at once (router/index/gate.py) —
when a probe finds it NOT_SERVING (draining) or it leaves the Redis registry (deregistered or
expired; the registry is re-read after every consumer poll, ~100 ms). When it serves again the
router asks it for its inventory.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contracts.roles import WorkerRole
from kvstore.metadata.registry import MetadataError, RedisConfig, redis_errors
from kvstore.metadata.streams import EventConsumer
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.index.blocks import BlockIndex
from router.index.compact import CompactBlockIndex
from router.index.gate import GatedIndex
from router.routing.types import WorkerId, WorkerInfo
from router.security.attest import Admitter, Verdict, worker_channel
from router.workers.live import IN_PLACE, LiveColumns, WorkerEntry

log = logging.getLogger("kvmesh.router")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_ROLES = frozenset(r.value for r in WorkerRole) | {""}
LOST_AFTER_PROBES = 2   # unanswered probes in a row before a worker's open streams migrate


class WorkerRegistry:
    """Worker entries, their probes, and the Redis-fed registry and block index (if any).
    `on_ready` is awaited (in a task) whenever "at least one worker is ready" flips."""

    def __init__(self, cfg: RouterConfig, on_ready: Callable[[bool], Awaitable[None]]) -> None:
        self.cfg = cfg
        # The block index; the Redis event streams feed it (with no metadata Redis it stays empty).
        # (the compact holder table: ~120 bytes per (block, worker) entry, `kvmesh bench scale`)
        self.index: BlockIndex = CompactBlockIndex(fed=cfg.redis_url is not None)
        self.model_info: pb.ModelInfo | None = None  # what the ready workers serve
        self.consumer: EventConsumer | None = None
        self.gate: GatedIndex | None = None          # the consumer's sink over `index`
        self.strict_tokenizer = False                # tokenizer_sha256 must be set (and agree)
        # A router with no model of its own (tokenizer from the workers) forgets the reference
        # model when no worker is ready, so that a roll to another model can complete; it calls
        # `on_forget` then (synchronously: the tokenizer of the old model must go with it).
        self.on_forget: Callable[[], None] | None = None
        self._on_ready = on_ready
        self._workers: dict[str, WorkerEntry] = {}
        self._live: LiveColumns | None = None        # the ready workers as columns (None: to rebuild)
        self._consume_task: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._admitter = Admitter(cfg)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Add the configured workers, start the Redis consumer (if configured), probe every
        worker once; returns why workers were refused (the caller decides if that is fatal).
        Call `run()` afterwards to keep probing."""
        self.set_workers(self.cfg.worker_addresses, probe=False)
        if self.cfg.redis_url is not None:
            await self._start_metadata(self.cfg.redis_url)
        return await self.probe_all()

    def run(self) -> None:
        """Probe every `health_interval_s` (or when woken) until `stop`."""
        self._monitor = asyncio.create_task(self._monitor_loop(), name="router-probes")

    async def stop(self) -> None:
        """Cancel probes and the consumer, close every channel (idempotent)."""
        for task in (self._monitor, self._consume_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._monitor = self._consume_task = None
        if self.consumer is not None:
            await self.consumer.aclose()
            self.consumer = None
        for w in self._workers.values():
            await w.channel.close()
        self._workers.clear()
        for task in list(self._background):
            task.cancel()

    async def wait_ready(self, timeout: float) -> None:
        """Until at least one worker is ready; raises TimeoutError."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    # -- membership -----------------------------------------------------------------------
    def set_workers(self, addresses: Iterable[str], *, probe: bool = True,
                    worker_ids: dict[str, WorkerId] | None = None) -> None:
        """Replace the worker set (call on the router's loop). New workers serve once a probe
        finds them ready; a removed worker leaves the block index at once and its in-flight
        streams get `request_timeout_s` to end. `worker_ids`: address → id, where known."""
        wanted = list(dict.fromkeys(addresses))
        for address in [a for a in self._workers if a not in wanted]:
            w = self._workers.pop(address)
            self._leave_index(w)
            self._spawn(w.channel.close(grace=self.cfg.request_timeout_s))
        for address in wanted:
            if address not in self._workers:
                channel = worker_channel(self.cfg, address, lambda a=address: self._admitted(a))
                self._workers[address] = WorkerEntry(address, channel, pb_grpc.WorkerStub(channel),
                                                     health_pb2_grpc.HealthStub(channel), watch=self._changed)
            if worker_ids and address in worker_ids:
                self._workers[address].worker_id = worker_ids[address]
        self._live = None
        self._update_ready()
        if probe:
            self._wake.set()

    def _admitted(self, address: str) -> bool:
        w = self._workers.get(address)
        return w is not None and w.admitted

    def live(self) -> list[WorkerEntry]:
        """Entries of the ready workers."""
        return [w for w in self._workers.values() if w.info is not None]

    def live_columns(self) -> LiveColumns:
        """The ready workers as columns, kept between calls (router/workers/live.py): rebuilt only
        after the ready set, a role or a peer plane changed. Read-only."""
        live = self._live
        if live is None:
            live = self._live = LiveColumns(list(self._workers.values()))
        return live

    def _changed(self, entry: WorkerEntry, name: str) -> None:
        """`entry.<name>` was assigned (a field the live columns keep)."""
        live = self._live
        if live is None:
            return
        if name in IN_PLACE:
            live.changed(entry, name)
        elif entry in live or entry.info is not None:   # (a worker not ready stays out)
            self._live = None

    def entry(self, address: str) -> WorkerEntry:
        return self._workers[address]

    def refuse(self, w: WorkerEntry, why: str) -> None:
        """`w` may never serve (logged once): it leaves routing and the block index."""
        reason = f"REFUSED worker at {w.address}: {why}; it will get no requests"
        log.error("kvmesh router: %s", reason)
        w.refused, w.info = reason, None
        self._leave_index(w)
        self._update_ready()

    def mark_down(self, w: WorkerEntry, why: str) -> None:
        """The worker failed a call: it stops serving until a probe finds it ready again."""
        if w.info is not None:
            log.warning("kvmesh router: worker %s at %s is unavailable: %s", w.info.worker_id, w.address, why)
        w.info = None
        self._update_ready()
        self._wake.set()

    # -- Redis: the registry and the block index --------------------------------------------
    async def _start_metadata(self, redis_url: str) -> None:
        self.gate = GatedIndex(self.index)
        self.consumer = consumer = EventConsumer(RedisConfig(url=redis_url, cluster_name=self.cfg.cluster_name),
                                                 self.gate)
        await consumer.poll()    # the registry, before the first probe
        self._sync_registry(probe=False)
        self._consume_task = asyncio.create_task(self._consume(consumer), name="kv-events")

    async def _consume(self, consumer: EventConsumer) -> None:
        """Follow the event streams; after each poll, follow the registry's membership too."""
        while True:
            await consumer.poll()
            self._sync_registry(probe=True)

    def _sync_registry(self, *, probe: bool) -> None:
        """Serve the static workers plus every live worker in the registry (a missed TTL drops
        it); a new one is probed now when `probe`."""
        if self.consumer is None:
            return
        records = self.consumer.workers.values()
        ids = {r.address: r.worker_id for r in records}
        wanted = list(dict.fromkeys([*self.cfg.worker_addresses, *ids]))
        if set(wanted) != set(self._workers):
            self.set_workers(wanted, probe=probe, worker_ids=ids)

    def _leave_index(self, w: WorkerEntry) -> None:
        """`w` left routing: its blocks leave the index now (unless its worker id serves at
        another address: a restart that moved)."""
        wid = w.info.worker_id if w.info is not None else w.worker_id
        if self.gate is None or wid is None:
            return
        if any(o is not w and o.info is not None and o.info.worker_id == wid for o in self._workers.values()):
            return
        if not self.gate.is_closed(wid):
            log.info("kvmesh router: worker %s at %s left routing; its blocks leave the index", wid, w.address)
        self.gate.close(wid)

    def _rejoin_index(self, worker_id: WorkerId) -> None:
        """`worker_id` serves again: let its events in and ask for its inventory."""
        if self.gate is not None and self.consumer is not None and self.gate.reopen(worker_id):
            self._spawn(self._request_inventory(self.consumer, worker_id))

    def request_inventory(self, worker_id: WorkerId) -> None:
        """Ask `worker_id` for a full inventory of its blocks (the router found its index entries
        stale, router/routing/predictions.py); nothing without a metadata Redis."""
        if self.consumer is not None:
            self._spawn(self._request_inventory(self.consumer, worker_id))

    async def _request_inventory(self, consumer: EventConsumer, worker_id: WorkerId) -> None:
        try:
            with redis_errors("request an inventory"):
                await consumer.request_resync(worker_id)
        except MetadataError as e:   # the consumer asks again after a gap or a Redis restart
            log.warning("kvmesh router: cannot ask worker %s for its inventory: %s", worker_id, e)

    # -- probes ---------------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.health_interval_s)
            self._wake.clear()
            self._sync_registry(probe=False)
            for error in await self.probe_all():
                log.warning("kvmesh router: %s", error)

    async def probe_all(self) -> list[str]:
        """Probe every worker; returns why newly refused workers may not serve."""
        results = await asyncio.gather(*(self._probe(w) for w in list(self._workers.values())))
        self._update_ready()
        return [r for r in results if r is not None]

    async def _probe(self, w: WorkerEntry) -> str | None:
        if w.refused is not None:
            return None
        async with w.probing:
            timeout = min(max(self.cfg.health_interval_s, 2.0), 10.0)
            try:
                status = await w.health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                              timeout=timeout)
                w.failed_probes = 0     # it answers (a draining worker's streams stay on it)
                if status.status != _SERVING:
                    self._leave_index(w)
                    w.info = None
                    return None
                if not w.admitted and not await self._admit(w, timeout):
                    return None
                load = await w.stub.GetLoad(pb.LoadRequest(), timeout=timeout)
                w.worker_id = WorkerId(load.worker_id)
                w.free_blocks, w.num_blocks = load.num_free_blocks, load.num_blocks
                w.reused_blocks = load.num_reused_blocks
                w.peer_plane = load.HasField("peer")    # pairs of such workers form on demand
                w.num_waiting = load.num_waiting
                w.disk_read_cost = max(0.0, load.disk_read_cost_ratio)
                role = WorkerRole.parse(load.role) if load.role in _ROLES else WorkerRole.MIXED
                if w.info is not None and w.info.role is not role:
                    w.info = WorkerInfo(w.info.worker_id, w.address, role)
                if w.info is not None:
                    return None
                info = await w.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                self._unanswered(w, e)
                w.admitted = False     # perhaps another process by now: the handshake again
                return None
            w.refused = self._mismatch(w, info, WorkerId(load.worker_id))
            if w.refused is not None:
                w.mismatched = True
                return w.refused
            if self.model_info is None:
                self.model_info = info
            w.info = WorkerInfo(WorkerId(load.worker_id), w.address, role)
            w.lost = asyncio.Event()
            self._rejoin_index(w.info.worker_id)
            log.info("kvmesh router: worker %s at %s is ready", load.worker_id, w.address)
            return None

    def _unanswered(self, w: WorkerEntry, e: grpc.aio.AioRpcError) -> None:
        """A probe got no answer: the worker leaves routing at once; after `LOST_AFTER_PROBES`
        in a row (a partition, a hung process) the streams still open on it move elsewhere."""
        if w.info is not None:
            log.warning("kvmesh router: worker %s at %s does not answer its probe: %s", w.info.worker_id,
                        w.address, e.code().name)
        w.info = None
        w.failed_probes += 1
        if w.failed_probes >= LOST_AFTER_PROBES:
            w.lost.set()

    async def _admit(self, w: WorkerEntry, timeout: float) -> bool:
        """router/security/attest.py's handshake; a rejected worker is refused for good (logged there)."""
        admission = await self._admitter.admit(w.address, w.stub, timeout)
        if admission.verdict is Verdict.REJECTED:
            w.refused = admission.reason
            return False
        w.admitted = True
        return True

    def _mismatch(self, w: WorkerEntry, info: pb.ModelInfo, worker_id: WorkerId) -> str | None:
        ref = self.model_info
        if self.strict_tokenizer and not info.tokenizer_sha256:
            return (f"worker at {w.address} reports no tokenizer_sha256 (it predates GetTokenizer) and the "
                    "router takes its tokenizer from the workers; refusing it")
        if ref is not None:
            for name in ("hash_salt_hex", "block_size", "vocab_size"):
                if getattr(info, name) != getattr(ref, name):
                    return (f"worker at {w.address} has {name}={getattr(info, name)!r} but the other "
                            f"workers have {getattr(ref, name)!r}; refusing it (block hashes must agree)")
            # "" is a worker that predates the field: it agrees unless the router needs the digest
            if info.tokenizer_sha256 != ref.tokenizer_sha256 and (
                    self.strict_tokenizer or (info.tokenizer_sha256 and ref.tokenizer_sha256)):
                return (f"worker at {w.address} has tokenizer_sha256={info.tokenizer_sha256!r} but the other "
                        f"workers have {ref.tokenizer_sha256!r}; refusing it (the tokenizers must agree)")
        other = next((o for o in self._workers.values()
                      if o is not w and o.info is not None and o.info.worker_id == worker_id), None)
        if other is not None:
            return f"worker at {w.address} has worker_id {worker_id!r}, already used by {other.address}"
        return None

    def _update_ready(self) -> None:
        ready = any(w.info is not None for w in self._workers.values())
        if ready != self._ready.is_set():
            (self._ready.set if ready else self._ready.clear)()
            if not ready and self.on_forget is not None:
                self._forget_model()
            self._spawn(self._on_ready(ready))

    def _forget_model(self) -> None:
        """No worker is ready: the next one to be ready sets the reference model again, and the
        workers refused for disagreeing with the old one are probed again."""
        if self.model_info is not None:
            log.info("kvmesh router: no worker is ready; the next ready worker sets the model (was %r, "
                     "tokenizer %s)", self.model_info.model, self.model_info.tokenizer_sha256[:12] or "-")
        self.model_info = None
        for w in self._workers.values():
            if w.mismatched:
                w.refused, w.mismatched = None, False
        assert self.on_forget is not None
        self.on_forget()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
