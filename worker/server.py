"""The gRPC edge of one worker: `kvmesh.v1.Worker` over an `AsyncEngine`, plus health and reflection.

Lifecycle: `start()` binds and serves at once with health NOT_SERVING, then loads the engine
in a thread; health turns SERVING when it is ready (`wait_ready`). `stop()` drains: health
NOT_SERVING, new Generate calls get UNAVAILABLE, in-flight streams get up to `grace` seconds
to finish, then the server and the engine thread stop.

This is the only worker module that maps exceptions to gRPC status codes. The module imports
no torch: the engine is imported when it is loaded, so `kvmesh --help` stays fast.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.convert import (FINISH_REASONS, BadRequest, ParsedRequest, parse_generate_request,
                           to_generate_input)
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.params import SamplingParamsError

if TYPE_CHECKING:
    from worker.async_engine import AsyncEngine
    from worker.engine import Engine, EngineConfig
    from worker.request import RequestOutput

log = logging.getLogger("kvmesh.worker")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name   # "kvmesh.v1.Worker"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerServerConfig:
    """Where the worker listens and how it drains. `advertise_address` (None → host:port) is
    what peers and the router dial. With `redis_url` the worker registers itself (heartbeat
    with a TTL) and publishes its KV events for the router's block index."""

    host: str = "127.0.0.1"
    port: int = 0                        # 0 = a free port, returned by start()
    worker_id: str = "worker-0"
    advertise_address: str | None = None
    drain_timeout_s: float = 30.0
    max_message_bytes: int = 4 * 2**20   # grpc's own default receive limit, made explicit
    redis_url: str | None = None
    cluster_name: str = "kvmesh"

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host is empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535] (0 = a free port)")
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id={self.worker_id!r} must be non-empty without spaces")
        if self.advertise_address is not None:
            host, sep, port = self.advertise_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"advertise_address={self.advertise_address!r} must be HOST:PORT")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be positive")
        if not self.cluster_name:
            raise ValueError("cluster_name is empty")


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
        limit = self.cfg.max_message_bytes
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", limit),
                                          ("grpc.max_send_message_length", limit)])
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (WORKER_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        self._port = server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        await server.start()
        self._server = server
        self._idle.set()
        self._load_task = asyncio.create_task(self._load(), name=f"load-{self.cfg.worker_id}")
        log.info("worker %s listening on %s:%d, loading %s", self.cfg.worker_id, self.cfg.host,
                 self._port, self.engine_cfg.model)
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
        mc = engine.model_config
        self._model_info = pb.ModelInfo(
            model=mc.name, vocab_size=mc.vocab_size, max_model_len=engine.max_model_len,
            block_size=engine.cfg.block_size, kv_cache_dtype=engine.layout.kv_cache_dtype,
            eos_token_ids=sorted(engine.eos_token_ids), hash_salt_hex=engine.salt.hex())
        self._engine = engine
        if self.cfg.redis_url is not None:
            self._metadata = await asyncio.to_thread(_Metadata, self.cfg, self.address, engine)
        self._ae = AsyncEngine(engine, after_step=self._metadata.after_step if self._metadata else None)
        if self._metadata is not None:
            self._metadata.heartbeater.start()
        for service in ("", WORKER_SERVICE):
            await self._health.set(service, _SERVING)
        log.info("worker %s serving %s (%d blocks of %d tokens)", self.cfg.worker_id, mc.name,
                 engine.pool.num_blocks, engine.cfg.block_size)

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
        assert self._load_task is not None
        if not self._load_task.done():
            self._load_task.cancel()   # the loading thread finishes on its own; its engine is dropped
        await asyncio.gather(self._load_task, return_exceptions=True)
        if self._ae is not None:
            ae, engine = self._ae, self._engine
            assert engine is not None
            # Requests whose streams were cancelled above: free their blocks before the thread stops.
            for rid in await ae.call(lambda: list(engine.requests)):
                await ae.abort(rid)
            await asyncio.to_thread(ae.shutdown)
        if self._metadata is not None:
            await asyncio.to_thread(self._metadata.close)
        log.info("worker %s stopped", self.cfg.worker_id)

    # -- RPCs -----------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], req: Any, resp: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                       response_serializer=resp.SerializeToString)
        return grpc.method_handlers_generic_handler(WORKER_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=parse_generate_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": unary(self._abort, pb.AbortRequest, pb.AbortResponse),
            "GetModelInfo": unary(self._get_model_info, pb.ModelInfoRequest, pb.ModelInfo),
            "GetLoad": unary(self._get_load, pb.LoadRequest, pb.Load),
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
        prompt: str | list[int]
        if inp.chat is not None:
            messages = [{"role": m.role, "content": m.content} for m in inp.chat]
            engine = ae.engine
            prompt = await ae.call(lambda: engine.apply_chat_template(messages))
        elif inp.text is not None:
            prompt = inp.text                 # encoded by add_request, on the engine thread
        else:
            assert inp.token_ids is not None
            prompt = list(inp.token_ids)
        outputs = ae.generate(prompt, inp.params, request_id, inp.priority)
        try:
            async for out in outputs:
                await context.write(self._response(out))
        finally:
            # Client cancelled or deadline passed (CancelledError here): closing the iterator
            # aborts the request and frees its blocks.
            await outputs.aclose()

    def _response(self, out: RequestOutput) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids,
                                   text=out.new_text, worker_id=self.cfg.worker_id)
        if out.finished:
            resp.finished = True
            resp.finish_reason = FINISH_REASONS.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
            resp.prompt_tokens = out.prompt_tokens
            resp.completion_tokens = out.completion_tokens
            resp.cached_tokens = out.num_cached_tokens
            self._prompt_tokens += out.prompt_tokens
            self._cached_prompt_tokens += out.num_cached_tokens
        return resp

    async def _abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        ae = await self._ready(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: empty")
        return await self._guard(context, self._abort_found(ae, request.request_id))

    async def _abort_found(self, ae: AsyncEngine, request_id: str) -> pb.AbortResponse:
        return pb.AbortResponse(found=await ae.abort(request_id))

    async def _get_model_info(self, request: pb.ModelInfoRequest,
                              context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._ready(context)
        return self._model_info

    async def _get_load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        ae = await self._ready(context)
        return await self._guard(context, self._load_now(ae))

    async def _load_now(self, ae: AsyncEngine) -> pb.Load:
        s = await ae.call(ae.engine.stats)
        return pb.Load(worker_id=self.cfg.worker_id, num_running=s.num_running, num_waiting=s.num_waiting,
                       num_free_blocks=s.num_free_blocks, num_used_blocks=s.num_used_blocks,
                       num_blocks=s.num_blocks, prefix_query_blocks=s.prefix_queries,
                       prefix_hit_blocks=s.prefix_hits, prompt_tokens=self._prompt_tokens,
                       cached_prompt_tokens=self._cached_prompt_tokens, num_preemptions=s.num_preemptions)

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


def _status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The one place worker exceptions become gRPC status codes."""
    from worker.request import InvalidRequest, QueueFull   # already loaded with the engine
    if isinstance(error, (BadRequest, InvalidRequest, SamplingParamsError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {error}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


class _Metadata:
    """The worker's side of the Redis metadata: registry + heartbeat, and the KV event
    stream of its pool. `after_step` runs on the engine thread (AsyncEngine's hook), so the
    events and the inventory it publishes are always in step with the pool."""

    def __init__(self, cfg: WorkerServerConfig, address: str, engine: Engine) -> None:
        from kvstore.events import WorkerId as EventWorkerId
        from kvstore.metadata import Heartbeater, RedisConfig, WorkerRecord, WorkerRegistry
        from kvstore.streams import EventPublisher

        assert cfg.redis_url is not None
        rcfg = RedisConfig(url=cfg.redis_url, cluster_name=cfg.cluster_name)
        self.registry = WorkerRegistry(rcfg)
        worker_id = EventWorkerId(cfg.worker_id)
        epoch = self.registry.new_epoch(worker_id)
        record = WorkerRecord(worker_id=cfg.worker_id, address=address, model=engine.model_config.name,
                              block_size=engine.cfg.block_size, num_blocks=engine.pool.num_blocks,
                              hash_salt_hex=engine.salt.hex(), epoch=epoch)
        sched = engine.scheduler
        self.heartbeater = Heartbeater(self.registry, record,
                                       load_fn=lambda: float(len(sched.running) + len(sched.waiting)))
        self.pool = engine.pool
        self.pool.set_event_recording(True)
        self.host = engine.host
        if self.host is not None:
            self.host.set_event_recording(True)
        self.publisher = EventPublisher(rcfg, worker_id, epoch, inventory_fn=self._inventory)
        self._next_poll = 0.0

    def _inventory(self) -> dict[Any, list[Any]]:
        from kvstore.events import Tier
        inventory = {Tier.DEVICE: self.pool.cached_hashes()}
        if self.host is not None:
            inventory[Tier.HOST] = self.host.cached_hashes()
        return inventory

    POLL_INTERVAL_S = 0.05

    def after_step(self) -> None:
        from kvstore.events import Tier
        events = self.pool.take_events()
        if events:
            self.publisher.publish(events)
        if self.host is not None:
            host_events = self.host.take_events()
            if host_events:
                self.publisher.publish(host_events, tier=Tier.HOST)
        # Resync requests and retries need no Redis round trip on every decode step.
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self.POLL_INTERVAL_S
            self.publisher.poll()

    def close(self) -> None:
        self.heartbeater.stop(deregister=True)
        self.publisher.close()
        self.registry.close()


# -- `kvmesh worker` ----------------------------------------------------------------------
def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    from worker.cli import add_engine_arguments
    g = p.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=0, help="port to bind (0 = a free port, printed when serving)")
    g.add_argument("--worker-id", default="worker-0")
    g.add_argument("--advertise-address", default=None, help="HOST:PORT peers dial (default: host:port)")
    g.add_argument("--redis-url", default=None, help="metadata Redis (worker registry)")
    g.add_argument("--cluster-name", default="kvmesh")
    g.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight streams may finish")
    add_engine_arguments(p)


def run_worker(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then drain. Prints one line to stdout once serving:
    `kvmesh worker <id> serving on <host>:<port>`; logs go to stderr."""
    from worker.cli import CLIError, engine_config_from_args, flagify
    engine_cfg = engine_config_from_args(args)
    try:
        cfg = WorkerServerConfig(host=args.host, port=args.port, worker_id=args.worker_id,
                                 advertise_address=args.advertise_address, drain_timeout_s=args.drain_timeout_s,
                                 redis_url=args.redis_url, cluster_name=args.cluster_name)
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve_until_signal(engine_cfg, cfg))


async def _serve_until_signal(engine_cfg: EngineConfig, cfg: WorkerServerConfig) -> int:
    from worker.cli import CLIError
    from worker.loader import ModelLoadError
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = WorkerServer(engine_cfg, cfg)
    try:
        try:
            port = await server.start()
        except RuntimeError as e:
            raise CLIError(f"--port: cannot bind {cfg.host}:{cfg.port}: {e}") from None
        ready = asyncio.ensure_future(server.wait_ready())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((ready, stopping), return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not stop.is_set():
            error = ready.exception()
            if isinstance(error, ModelLoadError):
                raise CLIError(f"--model: {error}")
            if error is not None:
                raise error
            print(f"kvmesh worker {cfg.worker_id} serving on {cfg.host}:{port}", flush=True)
            await stopping
        ready.cancel()
        log.info("worker %s: signal received, shutting down", cfg.worker_id)
    finally:
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0
