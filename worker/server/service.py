"""The gRPC edge of one worker: `kvmesh.v1.Worker` over an `AsyncEngine`, plus health and reflection.

Lifecycle: `start()` binds and serves at once (readiness NOT_SERVING, liveness SERVING; the
metrics port with /livez and /readyz too), then loads the engine in a thread; readiness turns
SERVING when it is ready (`wait_ready`). `stop()` drains: readiness NOT_SERVING (liveness stays
SERVING), new Generate calls get UNAVAILABLE, in-flight streams get up to `grace` seconds to
finish, then the server and the engine thread stop.

Liveness (worker/server/liveness.py, worker/server/health.py): a watchdog task on this loop turns the worker
not live when the engine thread stops beating for `liveness_timeout_s` or `max_step_failures`
steps in a row raised. Then, for good: liveness and readiness NOT_SERVING, the worker leaves the
Redis registry (its heartbeater stops), engine RPCs get UNAVAILABLE and running streams end with
UNAVAILABLE; the kubelet restarts the pod.

`GetTokenizer` sends the model's tokenizer files (contracts.tokenizer.TOKENIZER_FILES, read once
at load, at most MAX_TOKENIZER_BYTES) so that a router needs no model storage.

The block RPCs between workers (SendBlocks, HotBlocks, PullBlocks) are worker/server/block_rpcs.py's.
Handlers map exceptions to gRPC status codes through worker/server/status.py's `RpcGate` only. The module imports
no torch: the engine is imported when it is loaded, so `kvmesh --help` stays fast.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contracts.grpc_options import grpc_server_options
from contracts.tokenizer import MAX_TOKENIZER_MESSAGE_BYTES, TokenizerError
from contracts.wire import ParsedRequest, parse_generate_request, parse_send_blocks_request
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.engine.commands import ListRequests, ResetPrefixCache
from worker.server import cluster_auth
from worker.server.block_rpcs import BlockRPCs
from worker.server.config import WorkerServerConfig
from worker.server.generate_stream import GenerateStreams
from worker.server.health import WORKER_SERVICE, WorkerHealth
from worker.server.liveness import Liveness, watch
from worker.server.load import model_info, read_tokenizer, start_peer
from worker.server.metadata_hook import WorkerMetadata as _Metadata
from worker.server.responses import LOAD_WAIT_S, PREFILL_PROBE_TOKENS, disk_read_cost_ratio, load_response
from worker.server.scaling import Scaling
from worker.server.status import RpcGate, parse_or_none

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from worker.engine.async_engine import AsyncEngine
    from worker.engine.engine import Engine, EngineConfig
    from worker.peer.plane import PeerPlane
    from worker.server.metrics import WorkerMetrics
    from worker.server.metrics_http import MetricsHTTP

log = logging.getLogger("kvmesh.worker")

_STOP_ABORT_S = 10.0     # stop(): how long the engine thread may take to abort what still runs


class WorkerServer:
    """One grpc.aio server around one engine. Pass `engine` to serve an already-loaded
    Engine (tests share one); it must not be driven by anything else while this server runs.
    After `stop()` the Engine is idle and may be reused; the server cannot be restarted."""

    def __init__(self, engine_cfg: EngineConfig, cfg: WorkerServerConfig, engine: Engine | None = None) -> None:
        if engine_cfg.kv_disk_path:   # a directory per worker id: a restarted worker reopens its own records
            engine_cfg = replace(engine_cfg, kv_disk_path=os.path.join(engine_cfg.kv_disk_path, cfg.worker_id))
        self.engine_cfg = engine_cfg
        self.cfg = cfg
        self._engine = engine
        self._ae: AsyncEngine | None = None
        self._server: grpc.aio.Server | None = None
        self._liveness = Liveness(cfg.liveness_timeout_s, cfg.max_step_failures, worker_id=cfg.worker_id)
        self._health = WorkerHealth(self._liveness)
        self._gate = RpcGate(cfg.worker_id, self._liveness, lambda: self._ae)   # UNAVAILABLE; errors as statuses
        self._load_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._model_info = pb.ModelInfo()
        self._tokenizer: pb.TokenizerFiles | TokenizerError = TokenizerError("the model is loading")
        self._streams: set[asyncio.Task[Any]] = set()    # the running Generate handlers
        self._port = 0
        self._draining = False
        self._stopped = False
        self._num_inflight = 0
        self._idle = asyncio.Event()
        self._metadata: _Metadata | None = None
        self._peer: PeerPlane | None = None
        self._prefill_tokens_s = 0.0      # measured at start with a disk tier and no peer plane
        self._peer_calls = cluster_auth.PeerCalls(cfg)   # the control-plane calls of fetches
        self._gen = GenerateStreams(cfg.worker_id, self._peer_calls.ask)
        self.scaling = Scaling(cfg)        # drain hand-over, warm start (worker/server/scaling.py)
        self._blocks = BlockRPCs(cfg.worker_id, self._gate, self.scaling, self._peer_calls.ask,
                                 lambda: self._peer, lambda: self._draining)
        self._warm_task: asyncio.Task[int] | None = None
        self.metrics: WorkerMetrics | None = None       # set once loaded, with cfg.metrics_port
        self._metrics_registry: CollectorRegistry | None = None   # what /metrics serves
        self._metrics_http: MetricsHTTP | None = None
        self._metrics_task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """What peers dial: advertise_address, else host:bound port."""
        return self.cfg.advertise_address or f"{self.cfg.host}:{self._port}"

    @property
    def engine(self) -> Engine | None:
        """The loaded engine (None while loading). Touch it only after stop()."""
        return self._engine

    async def start(self) -> int:
        """Bind and serve (readiness NOT_SERVING, liveness SERVING), start loading the engine;
        return the bound port without waiting for the load — await `wait_ready()` for that.
        Raises OSError when the metrics port cannot be bound, RuntimeError for the gRPC port."""
        assert self._server is None, "start() called twice"
        await self._health.publish()
        if self.cfg.metrics_port is not None:   # first: the kubelet probes /livez while loading
            await self._start_metrics_http(self.cfg.metrics_port)
        # A worker sends its tokenizer files in one message, larger than any it accepts.
        options = grpc_server_options(self.cfg.max_message_bytes, self.cfg.grpc_idle_timeout_s,
                                      max_send_bytes=max(self.cfg.max_message_bytes, MAX_TOKENIZER_MESSAGE_BYTES))
        server = grpc.aio.server(options=options, interceptors=cluster_auth.server_interceptors(self.cfg))
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health.servicer, server)
        reflection.enable_server_reflection(
            (WORKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        try:
            self._port = cluster_auth.bind(server, self.cfg)
        except RuntimeError:
            if self._metrics_http is not None:
                await asyncio.to_thread(self._metrics_http.close)
            raise
        await server.start()
        self._server = server
        self._idle.set()
        self._load_task = asyncio.create_task(self._load(), name=f"load-{self.cfg.worker_id}")
        log.info("worker %s listening on %s:%d (%s), loading %s", self.cfg.worker_id, self.cfg.host,
                 self._port, ", ".join(cluster_auth.describe(self.cfg)), self.engine_cfg.model)
        return self._port

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the engine is loaded and health is SERVING; re-raises a load failure,
        TimeoutError after `timeout` (the load keeps going)."""
        assert self._load_task is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._load_task), timeout)

    async def _load(self) -> None:
        from worker.engine.async_engine import AsyncEngine
        from worker.engine.engine import Engine
        from worker.model.loader import ModelLoadError
        try:
            engine = self._engine or await asyncio.to_thread(Engine, self.engine_cfg)
        except Exception as e:
            log.error("worker %s: loading %s failed: %s", self.cfg.worker_id, self.engine_cfg.model, e,
                      exc_info=not isinstance(e, ModelLoadError))   # a bad --model needs no traceback
            raise
        if self.cfg.peer_transfer:     # before the engine thread and the event publisher start
            self._peer = await asyncio.to_thread(start_peer, self.cfg, engine)
        elif engine.store.disk is not None:   # what a disk read is priced against (the peer plane has its own)
            self._prefill_tokens_s = await asyncio.to_thread(engine.measure_prefill, PREFILL_PROBE_TOKENS)
        self._tokenizer = await asyncio.to_thread(read_tokenizer, self.cfg.worker_id, engine)
        self._model_info = model_info(engine, self._tokenizer)
        self._engine = engine
        self._gen.peer, self._gen.block_size = self._peer, engine.cfg.block_size
        if self.cfg.redis_url is not None:
            self._metadata = await asyncio.to_thread(_Metadata, self.cfg, self.address, engine)
        self._ae = AsyncEngine(engine, after_step=self._metadata.after_step if self._metadata else None,
                               stall_file=self.cfg.stall_file)
        self._liveness.attach(self._ae.pulse)
        self._watchdog = asyncio.create_task(self._watch(), name=f"watchdog-{self.cfg.worker_id}")
        if self._metadata is not None:
            self._metadata.heartbeater.start()
        if self._metrics_http is not None:
            self._start_metrics(engine, self._ae)
        await self._health.loaded()
        if self._peer is not None and self._metadata is not None and self.cfg.warm_start_mb_s > 0:
            self._warm_task = asyncio.create_task(self._warm(self._ae, self._peer, self._metadata, engine),
                                                  name=f"warm-{self.cfg.worker_id}")
        log.info("worker %s serving %s (%d blocks of %d tokens)", self.cfg.worker_id, self._model_info.model,
                 engine.store.num_blocks, engine.cfg.block_size)

    async def _warm(self, ae: AsyncEngine, peer: PeerPlane, metadata: _Metadata, engine: Engine) -> int:
        stats = await ae.snapshot(LOAD_WAIT_S)
        try:
            return await self.scaling.warm(ae, peer, self._peer_calls.ask, metadata.registry, engine.salt.hex(),
                                           stats.host_num_blocks - stats.num_host_blocks)
        except Exception:  # noqa: BLE001 - a warm start that fails leaves a cold worker, serving
            log.exception("worker %s: warm start failed", self.cfg.worker_id)
            return 0

    async def _hand_over(self, grace: float) -> int:
        if not (self.cfg.drain_handover and self._ae is not None and self._peer is not None
                and self._metadata is not None and self._engine is not None):
            return 0
        try:
            return await self.scaling.hand_over(self._ae, self._metadata.registry, self._engine.salt.hex(),
                                                self.address, asyncio.get_running_loop().time() + grace)
        except Exception:  # noqa: BLE001 - the drain goes on without the hand-over
            log.exception("worker %s: drain hand-over failed", self.cfg.worker_id)
            return 0

    async def _watch(self) -> None:
        await watch(self._liveness)      # logs the reason once (Liveness.check)
        await self._health.publish()
        for task in list(self._streams):
            task.cancel()          # their handlers answer UNAVAILABLE (_generate)
        if self._metadata is not None:
            self._metadata.mute()
            await asyncio.to_thread(self._metadata.heartbeater.stop, True)
            log.warning("worker %s left the registry (not live)", self.cfg.worker_id)

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics (/livez, /readyz) port once started (None: metrics off)."""
        return self._metrics_http.port if self._metrics_http is not None else None

    async def _start_metrics_http(self, port: int) -> None:
        from prometheus_client import CollectorRegistry

        from worker.server.metrics_http import MetricsHTTP
        self._metrics_registry = CollectorRegistry()
        self._metrics_http = await asyncio.to_thread(MetricsHTTP, self._metrics_registry, self.cfg.host, port,
                                                     self._health)
        log.info("worker %s metrics on http://%s:%d/metrics (probes: /livez, /readyz)", self.cfg.worker_id,
                 self.cfg.host, self._metrics_http.port)

    def _start_metrics(self, engine: Engine, ae: AsyncEngine) -> None:
        from worker.server.metrics import WorkerMetrics, refresh_forever
        self.metrics = self._gen.metrics = WorkerMetrics.for_engine(engine, self.cfg.worker_id, self._metrics_registry,
                                                                    role=self.cfg.role.value)
        if self._peer is not None:
            self._peer.fetch_observer = self.metrics.observe_peer_fetch
        self.scaling.on_handed_over = self.metrics.observe_handed_over
        self.scaling.on_warmed = self.metrics.observe_warmed
        self._metrics_task = asyncio.create_task(refresh_forever(self.metrics, ae, self._peer),
                                                 name=f"metrics-{self.cfg.worker_id}")

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop (idempotent). `grace` defaults to cfg.drain_timeout_s; streams still
        running after it are cancelled and their requests aborted."""
        if self._server is None or self._stopped:
            return
        self._stopped = self._draining = True
        grace = self.cfg.drain_timeout_s if grace is None else grace
        await self._health.draining()
        log.info("worker %s draining %d stream(s), up to %.1f s", self.cfg.worker_id, self._num_inflight, grace)
        if self._warm_task is not None:
            self._warm_task.cancel()
        handover = asyncio.ensure_future(self._hand_over(grace))   # beside the streams: same deadline
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            log.warning("worker %s: %d stream(s) still running after %.1f s; cancelling",
                        self.cfg.worker_id, self._num_inflight, grace)
        await asyncio.gather(handover, return_exceptions=True)     # bounded by its own deadline
        await self._server.stop(None)
        for task in (self._metrics_task, self._watchdog):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.close)
        assert self._load_task is not None
        if not self._load_task.done():
            self._load_task.cancel()   # the loading thread finishes on its own; its engine is dropped
        await asyncio.gather(self._load_task, return_exceptions=True)
        if self._ae is not None:
            # Requests whose streams were cancelled above: free their blocks before the thread
            # stops — unless the engine is not live: its thread may never answer (a hung device).
            live = self._liveness.check() is None
            try:
                if live:
                    await asyncio.wait_for(self._abort_all(self._ae), _STOP_ABORT_S)
            except TimeoutError:
                log.warning("worker %s: the engine thread did not abort the remaining requests in %.0f s",
                            self.cfg.worker_id, _STOP_ABORT_S)
            await asyncio.to_thread(self._ae.shutdown, 30.0 if live else 2.0)
        if self._metadata is not None:
            await asyncio.to_thread(self._metadata.close)
        if self._peer is not None:
            await asyncio.to_thread(self._peer.close)
        await self._peer_calls.close()
        await self.scaling.close()
        log.info("worker %s stopped", self.cfg.worker_id)

    @staticmethod
    async def _abort_all(ae: AsyncEngine) -> None:
        for rid in await ae.run(ListRequests()):
            await ae.abort(rid)

    # -- RPCs -----------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], req: Any, resp: Any) -> Any:
            async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request is None:   # bytes that are not a `req`: INVALID_ARGUMENT, no traceback
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {req.DESCRIPTOR.name}")
                return await fn(request, context)
            return grpc.unary_unary_rpc_method_handler(checked, request_deserializer=parse_or_none(req),
                                                       response_serializer=resp.SerializeToString)
        return grpc.method_handlers_generic_handler(WORKER_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=parse_generate_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": unary(self._abort, pb.AbortRequest, pb.AbortResponse),
            "GetModelInfo": unary(self._get_model_info, pb.ModelInfoRequest, pb.ModelInfo),
            "GetTokenizer": unary(self._get_tokenizer, pb.TokenizerRequest, pb.TokenizerFiles),
            "GetLoad": unary(self._get_load, pb.LoadRequest, pb.Load),
            "SendBlocks": grpc.unary_unary_rpc_method_handler(
                self._blocks.send_blocks, request_deserializer=parse_send_blocks_request,
                response_serializer=pb.SendBlocksResponse.SerializeToString),
            "HotBlocks": unary(self._blocks.hot_blocks, pb.HotBlocksRequest, pb.HotBlocksResponse),
            "PullBlocks": unary(self._blocks.pull_blocks, pb.PullBlocksRequest, pb.PullBlocksResponse),
            "ResetPrefixCache": unary(self._reset_prefix_cache, pb.ResetPrefixCacheRequest,
                                      pb.ResetPrefixCacheResponse),
            "Attest": unary(lambda r, c: cluster_auth.attest(self.cfg, self.address, r, c),
                            pb.AttestRequest, pb.AttestResponse),
        })

    async def _generate(self, parsed: ParsedRequest, context: grpc.aio.ServicerContext) -> None:
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id} is draining")
        ae = await self._gate.ready(context)
        if parsed.message is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed.error or "malformed request")
        self._num_inflight += 1
        self._idle.clear()
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        try:
            await self._gen.run(ae, parsed.message, context)
        except asyncio.CancelledError:
            dead = self._liveness.check()
            if dead is None:
                raise                  # the client went away, or the drain ran out
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id} is not live: {dead}")
        except Exception as e:  # noqa: BLE001 - mapped to a status; the server keeps serving
            await self._gate.fail(context, e)
        finally:
            self._streams.discard(task)
            self._num_inflight -= 1
            if self._num_inflight == 0:
                self._idle.set()

    async def _abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        ae = await self._gate.ready(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        return await self._gate.guard(context, self._abort_found(ae, request.request_id))

    async def _abort_found(self, ae: AsyncEngine, request_id: str) -> pb.AbortResponse:
        return pb.AbortResponse(found=await ae.abort(request_id))

    async def _reset_prefix_cache(self, request: pb.ResetPrefixCacheRequest,
                                  context: grpc.aio.ServicerContext) -> pb.ResetPrefixCacheResponse:
        ae = await self._gate.ready(context)
        return pb.ResetPrefixCacheResponse(reset=await self._gate.guard(context, ae.run(ResetPrefixCache())))

    async def _get_model_info(self, request: pb.ModelInfoRequest,
                              context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._gate.loaded(context)
        return self._model_info

    async def _get_tokenizer(self, request: pb.TokenizerRequest,
                             context: grpc.aio.ServicerContext) -> pb.TokenizerFiles:
        await self._gate.loaded(context)
        if isinstance(self._tokenizer, TokenizerError):
            await self._gate.fail(context, self._tokenizer)
        return self._tokenizer

    async def _get_load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        ae = await self._gate.ready(context)
        return await self._gate.guard(context, self._load_now(ae))

    async def _load_now(self, ae: AsyncEngine) -> pb.Load:
        stats = await ae.snapshot(LOAD_WAIT_S)
        load = load_response(self.cfg.worker_id, stats, self._gen.prompt_tokens, self._gen.cached_prompt_tokens,
                             self._peer.figures() if self._peer is not None else None)
        load.role, load.prefill_only_requests = self.cfg.role.value, self._gen.prefill_only_requests
        load.blocks_handed_over = self.scaling.counters.blocks_handed_over
        load.blocks_warmed = self.scaling.counters.blocks_warmed
        disk = self._engine.store.disk if self._engine is not None else None
        if disk is not None:
            load.disk_read_bytes_s = disk.stats().read_bytes_s(disk.payload_bytes)
            prefill = self._peer.prefill_tokens_per_s if self._peer is not None else self._prefill_tokens_s
            load.disk_read_cost_ratio = disk_read_cost_ratio(disk.payload_bytes, load.disk_read_bytes_s,
                                                             ae.engine.cfg.block_size, prefill)
        return load
