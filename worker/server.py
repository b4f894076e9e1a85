"""The gRPC edge of one worker: `kvmesh.v1.Worker` over an `AsyncEngine`, plus health and reflection.

Lifecycle: `start()` binds and serves at once with health NOT_SERVING, then loads the engine
in a thread; health turns SERVING when it is ready (`wait_ready`). `stop()` drains: health
NOT_SERVING, new Generate calls get UNAVAILABLE, in-flight streams get up to `grace` seconds
to finish, then the server and the engine thread stop.

This is the only worker module that maps exceptions to gRPC status codes. The module imports
no torch: the engine is imported when it is loaded, so `kvmesh --help` stays fast.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
import dataclasses
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contracts.grpc_options import grpc_server_options
from contracts.logs import REQUEST_ID, trace_id
from contracts.requests import BadRequest
from contracts.sampling import SamplingParamsError
from contracts.wire import (ParsedRequest, parse_generate_request, parse_send_blocks_request,
                            to_generate_input, to_send_blocks_input)
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker import cluster_auth
from worker.commands import ApplyChatTemplate, ListRequests, ResetPrefixCache, Snapshot, Tokenize
from worker.metadata_hook import WorkerMetadata as _Metadata
from worker.responses import stream_response
from worker.server_config import WorkerServerConfig

if TYPE_CHECKING:
    from worker.async_engine import AsyncEngine
    from worker.engine import Engine, EngineConfig
    from worker.peer import Fetched, PeerFigures, PeerPlane
    from worker.metrics import MetricsHTTP, WorkerMetrics
    from worker.request import RequestOutput

log = logging.getLogger("kvmesh.worker")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name   # "kvmesh.v1.Worker"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
T = TypeVar("T")
_SEND_MARGIN_S = 1.0     # SendBlocks: no send is queued with less of the caller's deadline left


class WorkerServer:
    """One grpc.aio server around one engine. Pass `engine` to serve an already-loaded
    Engine (tests share one); it must not be driven by anything else while this server runs.
    After `stop()` the Engine is idle and may be reused; the server cannot be restarted."""

    def __init__(self, engine_cfg: EngineConfig, cfg: WorkerServerConfig, engine: Engine | None = None) -> None:
        self.engine_cfg = engine_cfg
        self.cfg = cfg
        self._engine = engine
        self._ae: AsyncEngine | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._load_task: asyncio.Task[None] | None = None
        self._model_info = pb.ModelInfo()
        self._port = 0
        self._draining = False
        self._stopped = False
        self._num_inflight = 0
        self._idle = asyncio.Event()
        self._prompt_tokens = 0          # running totals over final messages sent
        self._cached_prompt_tokens = 0
        self._metadata: _Metadata | None = None
        self._peer: PeerPlane | None = None
        self._peer_calls = cluster_auth.PeerCalls(cfg)   # the control-plane calls of fetches
        self.metrics: WorkerMetrics | None = None       # set once loaded, with cfg.metrics_port
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
        """Bind and serve (health NOT_SERVING), start loading the engine; return the bound port
        without waiting for the load — await `wait_ready()` for that."""
        assert self._server is None, "start() called twice"
        for service in ("", WORKER_SERVICE):
            await self._health.set(service, _NOT_SERVING)
        options = grpc_server_options(self.cfg.max_message_bytes, self.cfg.grpc_idle_timeout_s)
        server = grpc.aio.server(options=options, interceptors=cluster_auth.server_interceptors(self.cfg))
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (WORKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        self._port = cluster_auth.bind(server, self.cfg)
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
        from worker.async_engine import AsyncEngine
        from worker.engine import Engine
        from worker.loader import ModelLoadError
        try:
            engine = self._engine or await asyncio.to_thread(Engine, self.engine_cfg)
        except Exception as e:
            log.error("worker %s: loading %s failed: %s", self.cfg.worker_id, self.engine_cfg.model, e,
                      exc_info=not isinstance(e, ModelLoadError))   # a bad --model needs no traceback
            raise
        if self.cfg.peer_transfer:     # before the engine thread and the event publisher start
            self._peer = await asyncio.to_thread(self._start_peer, engine)
        mc = engine.model_config
        self._model_info = pb.ModelInfo(
            model=mc.name, vocab_size=mc.vocab_size, max_model_len=engine.max_model_len,
            block_size=engine.cfg.block_size, kv_cache_dtype=engine.layout.kv_cache_dtype,
            eos_token_ids=sorted(engine.eos_token_ids), hash_salt_hex=engine.salt.hex(),
            attention_backend=engine.attention_backend.value)
        self._engine = engine
        if self.cfg.redis_url is not None:
            self._metadata = await asyncio.to_thread(_Metadata, self.cfg, self.address, engine)
        self._ae = AsyncEngine(engine, after_step=self._metadata.after_step if self._metadata else None)
        if self._metadata is not None:
            self._metadata.heartbeater.start()
        if self.cfg.metrics_port is not None:
            await self._start_metrics(engine, self._ae, self.cfg.metrics_port)
        for service in ("", WORKER_SERVICE):
            await self._health.set(service, _SERVING)
        log.info("worker %s serving %s (%d blocks of %d tokens)", self.cfg.worker_id, mc.name,
                 engine.store.num_blocks, engine.cfg.block_size)

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port once loaded (None: metrics off or not loaded yet)."""
        return self._metrics_http.port if self._metrics_http is not None else None

    async def _start_metrics(self, engine: Engine, ae: AsyncEngine, port: int) -> None:
        from worker.metrics import MetricsHTTP, WorkerMetrics, refresh_forever
        self.metrics = WorkerMetrics.for_engine(engine, self.cfg.worker_id)
        if self._peer is not None:
            self._peer.fetch_observer = self.metrics.observe_peer_fetch
        self._metrics_http = await asyncio.to_thread(MetricsHTTP, self.metrics.registry, self.cfg.host, port)
        self._metrics_task = asyncio.create_task(refresh_forever(self.metrics, ae, self._peer),
                                                 name=f"metrics-{self.cfg.worker_id}")
        log.info("worker %s metrics on http://%s:%d/metrics", self.cfg.worker_id, self.cfg.host,
                 self._metrics_http.port)

    def _start_peer(self, engine: Engine) -> PeerPlane | None:
        from kvstore.transfer_group import TransferConfig, TransferError
        from worker.peer import PeerConfig, PeerPlane
        advertise_host = self.cfg.advertise_address.rpartition(":")[0] if self.cfg.advertise_address else None
        timeout = self.cfg.transfer_timeout_s
        cfg = PeerConfig(self.cfg.worker_id, TransferConfig(timeout_s=timeout, connect_timeout_s=timeout),
                         store_host=self.cfg.host, store_port=self.cfg.transfer_port,
                         advertise_host=advertise_host, faults=self.cfg.transfer_faults)
        try:
            return PeerPlane.start(cfg, engine)
        except TransferError as e:
            log.error("worker %s: no peer transfer (serving without it): %s", self.cfg.worker_id, e)
            return None

    async def stop(self, grace: float | None = None) -> None:
        """Drain and stop (idempotent). `grace` defaults to cfg.drain_timeout_s; streams still
        running after it are cancelled and their requests aborted."""
        if self._server is None or self._stopped:
            return
        self._stopped = self._draining = True
        grace = self.cfg.drain_timeout_s if grace is None else grace
        await self._health.enter_graceful_shutdown()
        log.info("worker %s draining %d stream(s), up to %.1f s", self.cfg.worker_id, self._num_inflight, grace)
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            log.warning("worker %s: %d stream(s) still running after %.1f s; cancelling",
                        self.cfg.worker_id, self._num_inflight, grace)
        await self._server.stop(None)
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            await asyncio.gather(self._metrics_task, return_exceptions=True)
        if self._metrics_http is not None:
            await asyncio.to_thread(self._metrics_http.close)
        assert self._load_task is not None
        if not self._load_task.done():
            self._load_task.cancel()   # the loading thread finishes on its own; its engine is dropped
        await asyncio.gather(self._load_task, return_exceptions=True)
        if self._ae is not None:
            ae, engine = self._ae, self._engine
            assert engine is not None
            # Requests whose streams were cancelled above: free their blocks before the thread stops.
            for rid in await ae.run(ListRequests()):
                await ae.abort(rid)
            await asyncio.to_thread(ae.shutdown)
        if self._metadata is not None:
            await asyncio.to_thread(self._metadata.close)
        if self._peer is not None:
            await asyncio.to_thread(self._peer.close)
        await self._peer_calls.close()
        log.info("worker %s stopped", self.cfg.worker_id)

    # -- RPCs -----------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], req: Any, resp: Any) -> Any:
            async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request is None:   # bytes that are not a `req`: INVALID_ARGUMENT, no traceback
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {req.DESCRIPTOR.name}")
                return await fn(request, context)
            return grpc.unary_unary_rpc_method_handler(checked, request_deserializer=_parse_or_none(req),
                                                       response_serializer=resp.SerializeToString)
        return grpc.method_handlers_generic_handler(WORKER_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=parse_generate_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": unary(self._abort, pb.AbortRequest, pb.AbortResponse),
            "GetModelInfo": unary(self._get_model_info, pb.ModelInfoRequest, pb.ModelInfo),
            "GetLoad": unary(self._get_load, pb.LoadRequest, pb.Load),
            "SendBlocks": grpc.unary_unary_rpc_method_handler(
                self._send_blocks, request_deserializer=parse_send_blocks_request,
                response_serializer=pb.SendBlocksResponse.SerializeToString),
            "ResetPrefixCache": unary(self._reset_prefix_cache, pb.ResetPrefixCacheRequest,
                                      pb.ResetPrefixCacheResponse),
            "Attest": unary(lambda r, c: cluster_auth.attest(self.cfg, self.address, r, c),
                            pb.AttestRequest, pb.AttestResponse),
        })

    async def _generate(self, parsed: ParsedRequest, context: grpc.aio.ServicerContext) -> None:
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id} is draining")
        ae = await self._ready(context)
        if parsed.message is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed.error or "malformed request")
        self._num_inflight += 1
        self._idle.clear()
        try:
            await self._stream(ae, parsed.message, context)
        except Exception as e:  # noqa: BLE001 - mapped to a status; the server keeps serving
            await self._fail(context, e)
        finally:
            self._num_inflight -= 1
            if self._num_inflight == 0:
                self._idle.set()

    async def _stream(self, ae: AsyncEngine, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        inp = to_generate_input(msg)
        request_id = inp.request_id or uuid.uuid4().hex
        REQUEST_ID.set(trace_id(context, request_id))   # on every log line of this request
        prompt: str | list[int]
        if inp.chat is not None:
            prompt = await ae.run(ApplyChatTemplate(tuple((m.role, m.content) for m in inp.chat)))
        elif inp.text is not None:
            prompt = inp.text                 # encoded by add_request, on the engine thread
        else:
            assert inp.token_ids is not None
            prompt = list(inp.token_ids)
        fetched = None
        if inp.peer_hints and self._peer is not None:
            if isinstance(prompt, str):
                prompt = await ae.run(Tokenize(prompt))
            fetched = await self._peer.fetch(ae, prompt, inp.peer_hints, self._peer_calls.ask, inp.cache_salt)
        outputs = ae.generate(prompt, inp.params, request_id, inp.priority,
                              staged=fetched.staged if fetched is not None else None,
                              cache_salt=inp.cache_salt, fit_context=inp.max_tokens_given,
                              resume_tokens=inp.resume_tokens)
        t0, first = time.perf_counter(), True
        gaps = self.metrics.token_gaps() if self.metrics is not None else None
        completion_tokens = 0          # over every sequence (n / best_of)
        try:
            async for out in outputs:
                if gaps is not None:
                    gaps.output(out)
                if first and self._peer is not None:
                    self._peer.observe_prefill(out.prompt_tokens - out.num_cached_tokens, time.perf_counter() - t0)
                first = False
                completion_tokens += out.completion_tokens if out.finished else 0
                await context.write(self._response(out, fetched, completion_tokens))
        finally:
            # Client cancelled or deadline passed (CancelledError here): closing the iterator
            # aborts the request and frees its blocks.
            await outputs.aclose()

    def _response(self, out: RequestOutput, fetched: Fetched | None = None,
                  completion_tokens: int = 0) -> pb.GenerateResponse:
        resp = stream_response(out, self.cfg.worker_id)
        if out.finished and out.group_finished:
            resp.finished = True
            resp.prompt_tokens = out.prompt_tokens
            resp.completion_tokens = max(completion_tokens, out.completion_tokens)
            resp.cached_tokens = out.num_cached_tokens
            if fetched is not None:   # the fetched blocks follow the local ones, if admission used them
                assert self._engine is not None
                bs = self._engine.cfg.block_size
                resp.peer_cached_tokens = min(max(out.num_cached_tokens - fetched.num_local * bs, 0),
                                              fetched.num_blocks * bs)
            self._prompt_tokens += out.prompt_tokens
            if self.metrics is not None:
                self.metrics.observe_finished(out, resp.completion_tokens)
            t = out.timings
            log.info("request %s finished on %s: prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
                     "ttft_s=%.4f e2e_s=%.4f finish_reason=%s", out.request_id, self.cfg.worker_id,
                     out.prompt_tokens, out.num_cached_tokens, out.completion_tokens, t.ttft_s or 0.0,
                     t.e2e_s or 0.0, out.finish_reason)
            self._cached_prompt_tokens += out.num_cached_tokens
        return resp

    async def _abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        ae = await self._ready(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        return await self._guard(context, self._abort_found(ae, request.request_id))

    async def _abort_found(self, ae: AsyncEngine, request_id: str) -> pb.AbortResponse:
        return pb.AbortResponse(found=await ae.abort(request_id))

    async def _send_blocks(self, request: pb.SendBlocksRequest | str,
                           context: grpc.aio.ServicerContext) -> pb.SendBlocksResponse:
        ae = await self._ready(context)
        if isinstance(request, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request)
        return await self._guard(context, self._send_now(ae, request, context))   # type: ignore[arg-type]

    async def _send_now(self, ae: AsyncEngine, request: pb.SendBlocksRequest,
                        context: grpc.aio.ServicerContext) -> pb.SendBlocksResponse:
        from worker.peer import PeerTransferOff
        inp = to_send_blocks_input(request)
        if self._peer is None:
            raise PeerTransferOff(f"worker {self.cfg.worker_id} has peer transfer off")

        def still_wanted() -> bool:    # the answer must reach the caller before its deadline
            remaining = context.time_remaining()
            return not context.done() and (remaining is None or remaining > _SEND_MARGIN_S)
        num_blocks, num_bytes, reason, unknown = await self._peer.serve_send(ae, inp, still_wanted)
        return pb.SendBlocksResponse(num_blocks=num_blocks, num_bytes=num_bytes, reason=reason,
                                     generation=self._peer.me.generation, pair_unknown=unknown)

    async def _reset_prefix_cache(self, request: pb.ResetPrefixCacheRequest,
                                  context: grpc.aio.ServicerContext) -> pb.ResetPrefixCacheResponse:
        ae = await self._ready(context)
        return pb.ResetPrefixCacheResponse(reset=await self._guard(context, ae.run(ResetPrefixCache())))

    async def _get_model_info(self, request: pb.ModelInfoRequest,
                              context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._ready(context)
        return self._model_info

    async def _get_load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        ae = await self._ready(context)
        return await self._guard(context, self._load_now(ae))

    async def _load_now(self, ae: AsyncEngine) -> pb.Load:
        s = await ae.run(Snapshot())
        load = pb.Load(worker_id=self.cfg.worker_id, num_running=s.num_running, num_waiting=s.num_waiting,
                       num_free_blocks=s.num_free_blocks, num_used_blocks=s.num_used_blocks,
                       num_blocks=s.num_blocks, prefix_query_blocks=s.prefix_queries,
                       prefix_hit_blocks=s.prefix_hits, prompt_tokens=self._prompt_tokens,
                       cached_prompt_tokens=self._cached_prompt_tokens, num_preemptions=s.num_preemptions,
                       num_host_blocks=s.num_host_blocks, host_num_blocks=s.host_num_blocks,
                       num_onloaded_blocks=s.num_onloaded_blocks,
                       num_cached_blocks=s.num_cached_blocks, num_offloaded_blocks=s.num_offloaded_blocks)
        if self._peer is not None:
            load.peer.CopyFrom(_peer_stats(self._peer.figures()))
        return load

    # -- errors ---------------------------------------------------------------------------
    async def _ready(self, context: grpc.aio.ServicerContext) -> AsyncEngine:
        if self._ae is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id} is loading its model")
        assert self._ae is not None
        return self._ae

    async def _guard(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        try:
            return await work
        except Exception as e:  # noqa: BLE001 - mapped to a status; the server keeps serving
            await self._fail(context, e)

    async def _fail(self, context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
        if isinstance(error, grpc.aio.AbortError):
            raise error
        code, details = _status_for(error)
        if code is grpc.StatusCode.INTERNAL:
            log.error("worker %s: unexpected error in a handler", self.cfg.worker_id, exc_info=error)
        await context.abort(code, details)
        raise AssertionError("context.abort returned")   # it always raises


def _peer_stats(f: PeerFigures) -> pb.PeerStats:
    links = [pb.PeerLink(worker_id=w, bandwidth_bytes_s=e.bandwidth_bytes_s if e else 0.0,
                         latency_s=e.latency_s if e else 0.0, lost=f.lost.get(w, ""))
             for w in sorted(f.links.keys() | f.lost.keys()) for e in (f.links.get(w),)]
    return pb.PeerStats(
        worker_id=f.me.worker_id, generation=f.me.generation, store_address=f.store_address,
        pairs_formed=f.pairs_formed, pairs_broken=f.pairs_broken, backend=f.backend,
        prefill_tokens_per_s=f.prefill_tokens_per_s, checksum_bytes_s=f.checksum_bytes_s, links=links,
        **dataclasses.asdict(f.counters))


def _status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place worker exceptions become gRPC status codes."""
    from worker.peer import InvalidPeerRequest, PeerTransferOff
    from worker.request import InvalidRequest, QueueFull   # already loaded with the engine
    if isinstance(error, (BadRequest, InvalidRequest, SamplingParamsError, InvalidPeerRequest)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, PeerTransferOff):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {error}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


def _parse_or_none(cls: Any) -> Callable[[bytes], Any]:
    """A request deserializer that yields None for bytes that are not a `cls` instead of
    raising inside grpc (UNKNOWN and a logged traceback)."""
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError:
            return None
    return parse
