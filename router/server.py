"""The router: the gRPC front door (and the OpenAI HTTP one, router/http.py) before the workers.

One request: strict parse → validate → tokenize (text / chat) or range-check (token ids) →
chained block hashes → the policy picks a live worker → forward as token ids with the
remaining deadline → stream the worker's responses back unchanged. The router imports no
torch. This module is the only place in router/ that maps errors to gRPC status codes.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.keys import block_hashes
from proto.convert import BadRequest, GenerateInput, ParsedRequest, PeerHint, from_sampling_params, \
    parse_generate_request, to_generate_input, to_peer_hint
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.policy import (ROUTING_POLICIES, BlockIndexView, RouteRequest, RoutingState, WorkerId, WorkerInfo, WorkerLoad,
                           make_policy)
from router.tokenizer import RouterTokenizer, TokenizerError

log = logging.getLogger("kvmesh.router")

ROUTER_SERVICE = pb.DESCRIPTOR.services_by_name["Router"].full_name
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`http_port=None` serves no HTTP; port 0 binds a free port. `model` names the tokenizer
    (an alias or HF dir, as for workers); `redis_url` / `cluster_name` are kept for the index."""

    worker_addresses: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int | None = 0
    model: str = "smollm2"
    served_model_name: str | None = None    # the HTTP model id; None: `model`
    request_timeout_s: float = 600.0        # upstream deadline when the client sets none
    max_message_bytes: int = 4 * 2**20      # gRPC receive limit and HTTP body limit
    health_interval_s: float = 1.0          # how often workers are probed
    redis_url: str | None = None
    cluster_name: str = "kvmesh"
    routing_policy: str = "kv_aware"
    load_factor: float = 1.25

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_addresses", tuple(self.worker_addresses))
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy={self.routing_policy!r}; accepted: {', '.join(ROUTING_POLICIES)}")
        if not self.load_factor >= 1.0:
            raise ValueError(f"load_factor={self.load_factor!r} must be >= 1 (1.25 is the default)")
        for a in self.worker_addresses:
            if not isinstance(a, str) or ":" not in a:
                raise ValueError(f"worker_addresses: {a!r} is not HOST:PORT")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and (not isinstance(port, int) or not 0 <= port <= 65535):
                raise ValueError(f"{name}={port!r} must be in [0, 65535]")
        for name in ("request_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not isinstance(self.max_message_bytes, int) or self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes={self.max_message_bytes!r} must be a positive integer")


class RouterError(Exception):
    """Base of the router's errors."""


class RouterStartError(RouterError):
    """The router cannot serve: workers disagree on the model / block hashing (`field` is
    "worker_addresses"), or the model has no usable tokenizer (`field` is "model")."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class NoWorkerAvailable(RouterError):
    """No live worker can take the request now (gRPC UNAVAILABLE, HTTP 503)."""


class UpstreamError(RouterError):
    """A worker answered with an error status; passed on to the client as is."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Prepared(NamedTuple):
    """A validated request, ready to forward: the worker-bound message and what routing sees."""

    request: pb.GenerateRequest
    route: RouteRequest


@dataclass(eq=False)
class _Worker:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    info: WorkerInfo | None = None          # set while the worker is ready
    in_flight: int = 0                      # streams the router has open on it
    free_blocks: int = 0                    # from its last GetLoad
    num_blocks: int = 0
    rank: int | None = None                 # in the peer-transfer group (from GetLoad), if any
    world_size: int = 0
    refused: str | None = None              # why it may never serve (logged once)
    probing: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class RoutingStats:
    """Did the router's idea of each worker's cache (the block index) match what the worker
    found? `mismatches` counts requests where the two differ (the hash-agreement metric)."""

    requests: int = 0
    routed_hit_tokens: int = 0
    actual_hit_tokens: int = 0
    mismatches: int = 0
    peer_hints: int = 0         # requests forwarded with a hint to a peer holding more blocks

    def record(self, predicted: int, actual: int) -> None:
        self.requests += 1
        self.routed_hit_tokens += predicted
        self.actual_hit_tokens += actual
        self.mismatches += predicted != actual


class RouterServer:
    """Owns the gRPC server, the optional HTTP front, the worker channels and their probes."""

    def __init__(self, cfg: RouterConfig, tokenizer: RouterTokenizer | None = None) -> None:
        self.cfg = cfg
        self.policy = make_policy(cfg.routing_policy, cfg.load_factor)
        self.index: BlockIndexView | None = None   # set when a Redis-fed block index runs
        self._consumer: object | None = None        # kvstore.streams.EventConsumer (lazy: redis)
        self._consume_task: asyncio.Task[None] | None = None
        self.stats = RoutingStats()
        self._tokenizer = tokenizer
        self._workers: dict[str, _Worker] = {}
        self._model_info: pb.ModelInfo | None = None
        self._inflight: dict[str, _Worker | None] = {}
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._http: object | None = None   # router.http.HttpFrontend (imported lazily: aiohttp)
        self._monitor: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._closing: set[asyncio.Task[None]] = set()
        self._draining = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> tuple[int, int | None]:
        """Bind, probe the workers once, then keep probing; returns (grpc_port, http_port).

        Raises RouterStartError when the workers that answered disagree on block hashing
        (hash_salt_hex, block_size, vocab_size) or the model has no tokenizer. Health turns
        SERVING as soon as one worker is ready (`wait_ready`).
        """
        if self._tokenizer is None:
            from worker.loader import ModelLoadError, resolve_model_dir
            try:
                self._tokenizer = RouterTokenizer.from_model_dir(resolve_model_dir(self.cfg.model, progress=False))
            except (ModelLoadError, TokenizerError) as e:
                raise RouterStartError(f"model {self.cfg.model!r}: {e}", "model") from None
        opts = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", self.cfg.max_message_bytes),
                ("grpc.max_send_message_length", self.cfg.max_message_bytes)]
        self._server = grpc.aio.server(options=opts)
        self._server.add_generic_rpc_handlers((self._router_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((ROUTER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self._server)
        await self._set_health(False)
        grpc_port = self._server.add_insecure_port(f"{self.cfg.host}:{self.cfg.grpc_port}")
        await self._server.start()
        http_port = None
        try:
            if self.cfg.http_port is not None:
                from router.http import HttpFrontend
                self._http = frontend = HttpFrontend(self)
                http_port = await frontend.start(self.cfg.host, self.cfg.http_port)
            self.set_workers(self.cfg.worker_addresses, probe=False)
            if self.cfg.redis_url is not None:
                await self._start_metadata()
            errors = await self._probe_all()
            if errors:
                raise RouterStartError("; ".join(errors), "worker_addresses")
        except BaseException:
            await self.stop(0)
            raise
        self._monitor = asyncio.create_task(self._monitor_loop())
        return grpc_port, http_port

    async def wait_ready(self, timeout: float) -> None:
        """Until at least one worker is ready; raises TimeoutError."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, let in-flight streams finish for `grace` s, close everything
        (idempotent)."""
        if self._draining:
            return
        self._draining = True
        await self._set_health(False)
        for task in (self._monitor, self._consume_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._consumer is not None:
            await self._consumer.aclose()  # type: ignore[attr-defined]
        await asyncio.gather(self._http.stop(grace) if self._http is not None else asyncio.sleep(0),  # type: ignore[attr-defined]
                             self._server.stop(grace) if self._server is not None else asyncio.sleep(0))
        for w in self._workers.values():
            await w.channel.close()
        self._workers.clear()
        for task in list(self._closing):
            task.cancel()

    def set_workers(self, addresses: Iterable[str], *, probe: bool = True) -> None:
        """Replace the worker set (call on the router's loop). New workers serve once a probe
        finds them ready; a removed worker's in-flight streams get `request_timeout_s` to end."""
        wanted = list(dict.fromkeys(addresses))
        for address in [a for a in self._workers if a not in wanted]:
            w = self._workers.pop(address)
            task = asyncio.create_task(w.channel.close(grace=self.cfg.request_timeout_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for address in wanted:
            if address not in self._workers:
                channel = grpc.aio.insecure_channel(address)
                self._workers[address] = _Worker(address, channel, pb_grpc.WorkerStub(channel),
                                                 health_pb2_grpc.HealthStub(channel))
        self._update_ready()
        if probe:
            self._wake.set()

    @property
    def model_info(self) -> pb.ModelInfo | None:
        """What the ready workers serve (None until one was ready)."""
        return self._model_info

    @property
    def serving(self) -> bool:
        return self._ready.is_set() and not self._draining

    def live_workers(self) -> list[WorkerInfo]:
        return [w.info for w in self._workers.values() if w.info is not None]

    # -- the request path (gRPC and HTTP alike) --------------------------------------------
    async def prepare(self, inp: GenerateInput) -> Prepared:
        """Tokenize (in a thread: a 4 MiB prompt takes seconds) and validate; raises
        BadRequest, or NoWorkerAvailable before any worker has told the router its model."""
        info, tok = self._model_info, self._tokenizer
        if info is None or tok is None:
            raise NoWorkerAvailable("no worker is ready")
        try:
            if inp.text is not None:
                ids = await asyncio.to_thread(tok.encode, inp.text)
            elif inp.chat is not None:
                messages = [{"role": m.role, "content": m.content} for m in inp.chat]
                ids = await asyncio.to_thread(tok.apply_chat_template, messages)
            else:
                ids = list(inp.token_ids or ())
                bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
                if bad is not None:
                    raise BadRequest(f"token_ids: {bad} is outside the vocabulary [0, {info.vocab_size})")
        except TokenizerError as e:
            raise BadRequest(f"chat: {e}") from None
        if not ids:
            raise BadRequest("input: the prompt is empty after tokenization")
        if len(ids) >= info.max_model_len:
            raise BadRequest(f"input: the prompt has {len(ids)} tokens; this model takes at most "
                             f"{info.max_model_len - 1} (max_model_len {info.max_model_len})")
        hashes = block_hashes(ids, info.block_size, bytes.fromhex(info.hash_salt_hex))
        request = pb.GenerateRequest(request_id=inp.request_id or f"rtr-{uuid.uuid4().hex}",
                                     token_ids=pb.TokenIds(ids=ids), sampling=from_sampling_params(inp.params),
                                     priority=inp.priority)
        return Prepared(request, RouteRequest(tuple(ids), tuple(hashes)))

    async def generate(self, prepared: Prepared, timeout: float | None) -> AsyncIterator[pb.GenerateResponse]:
        """Forward to the policy's worker and yield its responses. A worker that is
        UNAVAILABLE before its first response is marked down and the request retried once on
        another. Closing the iterator cancels the upstream call (the worker aborts it).
        Raises BadRequest (request_id in flight), NoWorkerAvailable, UpstreamError."""
        rid = prepared.request.request_id
        if rid in self._inflight:
            raise BadRequest(f"request_id {rid!r} is already running")
        deadline = time.monotonic() + (timeout if timeout is not None else self.cfg.request_timeout_s)
        self._inflight[rid] = None
        tried: set[WorkerId] = set()
        try:
            for attempt in range(2):
                worker, predicted, hint = self._pick(prepared.route, tried)
                tried.add(worker.info.worker_id)  # type: ignore[union-attr]
                self._inflight[rid] = worker
                request = prepared.request
                if hint is not None:
                    request = pb.GenerateRequest()
                    request.CopyFrom(prepared.request)
                    request.peer_hints.append(to_peer_hint(hint))
                    self.stats.peer_hints += 1
                call = worker.stub.Generate(request, timeout=max(deadline - time.monotonic(), 0.001))
                streamed = False
                worker.in_flight += 1
                try:
                    async for response in call:
                        streamed = True
                        if response.finished:   # what came from a peer is no index mismatch
                            self.stats.record(predicted, response.cached_tokens - response.peer_cached_tokens)
                        yield response
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise UpstreamError(e.code(), e.details() or "") from None
                    self._mark_down(worker, e.details() or "")
                    if streamed or attempt == 1:
                        raise UpstreamError(grpc.StatusCode.UNAVAILABLE,
                                            f"worker {worker.address} became unavailable: {e.details()}") from None
                finally:
                    worker.in_flight -= 1
                    call.cancel()
        finally:
            self._inflight.pop(rid, None)

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight on the worker serving it; False when none is."""
        worker = self._inflight.get(request_id)
        if worker is None:
            return False
        try:
            response = await worker.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise UpstreamError(e.code(), e.details() or "") from None
        return bool(response.found)

    def routing_state(self, route: RouteRequest) -> RoutingState:
        live = [w for w in self._workers.values() if w.info is not None]
        loads = {w.info.worker_id: WorkerLoad(w.in_flight, w.free_blocks, w.num_blocks)  # type: ignore[union-attr]
                 for w in live}
        cached = self.index.match_prefix(route.block_hashes, list(loads)) if self.index is not None else {}
        return RoutingState(loads, cached)

    def _pick(self, route: RouteRequest, tried: set[WorkerId]) -> tuple[_Worker, int, PeerHint | None]:
        """The worker, the prompt tokens the index says it will find cached there, and the
        peer to hint when another live worker holds more of the prompt."""
        state = self.routing_state(route)
        chosen = self.policy.pick(self.live_workers(), route, state, exclude=tried)
        if chosen is None:
            raise NoWorkerAvailable("no worker is available" + (" (retry failed)" if tried else ""))
        bs = self._model_info.block_size if self._model_info is not None else 0
        # The worker recomputes at least the last prompt token, as the engine's lookup does.
        max_blocks = (len(route.token_ids) - 1) // bs if bs else 0
        blocks = min(state.cached_blocks.get(chosen.worker_id, 0), max_blocks)
        peers = {w.info.worker_id: (w.address, w.rank, w.world_size) for w in self._workers.values()
                 if w.info is not None and w.rank is not None}
        hint = best_peer_hint(chosen.worker_id, state.cached_blocks, peers, max_blocks)
        return self._workers[chosen.address], blocks * bs, hint

    # -- Redis metadata: worker registry and block index ------------------------------------
    async def _start_metadata(self) -> None:
        from kvstore.metadata import RedisConfig
        from kvstore.streams import EventConsumer
        from router.index import BlockIndex
        assert self.cfg.redis_url is not None
        index = BlockIndex()
        self._consumer = consumer = EventConsumer(RedisConfig(url=self.cfg.redis_url, cluster_name=self.cfg.cluster_name),
                                                  index)
        self.index = index
        stop = asyncio.Event()
        self._consume_task = asyncio.create_task(consumer.run(stop), name="kv-events")
        await consumer.poll()    # the registry, before the first probe
        self._sync_registry()

    def _sync_registry(self) -> None:
        """Serve the static workers plus every live worker in the registry (a missed TTL drops it)."""
        if self._consumer is None:
            return
        registered = [r.address for r in self._consumer.workers.values()]  # type: ignore[attr-defined]
        wanted = list(dict.fromkeys([*self.cfg.worker_addresses, *registered]))
        if set(wanted) != set(self._workers):
            self.set_workers(wanted, probe=False)

    # -- gRPC service ---------------------------------------------------------------------
    def _router_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(ROUTER_SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._grpc_generate, request_deserializer=parse_generate_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._grpc_abort, request_deserializer=pb.AbortRequest.FromString,
                response_serializer=pb.AbortResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._grpc_model_info, request_deserializer=pb.ModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString),
        })

    async def _grpc_generate(self, parsed: ParsedRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if parsed.message is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, parsed.error or "malformed request")
        try:
            prepared = await self.prepare(to_generate_input(parsed.message))  # type: ignore[arg-type]
            async with contextlib.aclosing(self.generate(prepared, context.time_remaining())) as stream:
                async for response in stream:
                    yield response
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoWorkerAvailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except UpstreamError as e:
            await context.abort(e.code, e.details)

    async def _grpc_abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            return pb.AbortResponse(found=await self.abort(request.request_id))
        except UpstreamError as e:
            await context.abort(e.code, e.details)
            raise AssertionError("unreachable") from None

    async def _grpc_model_info(self, request: pb.ModelInfoRequest,
                               context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self._model_info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        return self._model_info  # type: ignore[return-value]

    # -- workers: probes and health -------------------------------------------------------
    async def _monitor_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.health_interval_s)
            self._wake.clear()
            self._sync_registry()
            for error in await self._probe_all():
                log.warning("kvmesh router: %s", error)

    async def _probe_all(self) -> list[str]:
        """Probe every worker; returns why newly refused workers may not serve."""
        results = await asyncio.gather(*(self._probe(w) for w in list(self._workers.values())))
        self._update_ready()
        return [r for r in results if r is not None]

    async def _probe(self, w: _Worker) -> str | None:
        if w.refused is not None:
            return None
        async with w.probing:
            timeout = min(max(self.cfg.health_interval_s, 2.0), 10.0)
            try:
                status = await w.health.Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                              timeout=timeout)
                if status.status != _SERVING:
                    w.info = None
                    return None
                load = await w.stub.GetLoad(pb.LoadRequest(), timeout=timeout)
                w.free_blocks, w.num_blocks = load.num_free_blocks, load.num_blocks
                in_group = load.HasField("peer") and load.peer.world_size > 1
                w.rank, w.world_size = (load.peer.rank, load.peer.world_size) if in_group else (None, 0)
                if w.info is not None:
                    return None
                info = await w.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError:
                w.info = None
                return None
            w.refused = self._mismatch(w, info, WorkerId(load.worker_id))
            if w.refused is not None:
                return w.refused
            if self._model_info is None:
                self._model_info = info
            w.info = WorkerInfo(WorkerId(load.worker_id), w.address)
            log.info("kvmesh router: worker %s at %s is ready", load.worker_id, w.address)
            return None

    def _mismatch(self, w: _Worker, info: pb.ModelInfo, worker_id: WorkerId) -> str | None:
        ref = self._model_info
        if ref is not None:
            for name in ("hash_salt_hex", "block_size", "vocab_size"):
                if getattr(info, name) != getattr(ref, name):
                    return (f"worker at {w.address} has {name}={getattr(info, name)!r} but the other "
                            f"workers have {getattr(ref, name)!r}; refusing it (block hashes must agree)")
        other = next((o for o in self._workers.values()
                      if o is not w and o.info is not None and o.info.worker_id == worker_id), None)
        if other is not None:
            return f"worker at {w.address} has worker_id {worker_id!r}, already used by {other.address}"
        return None

    def _mark_down(self, w: _Worker, why: str) -> None:
        if w.info is not None:
            log.warning("kvmesh router: worker %s at %s is unavailable: %s", w.info.worker_id, w.address, why)
        w.info = None
        self._update_ready()
        self._wake.set()

    def _update_ready(self) -> None:
        ready = any(w.info is not None for w in self._workers.values())
        if ready != self._ready.is_set():
            (self._ready.set if ready else self._ready.clear)()
            task = asyncio.ensure_future(self._set_health(ready))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _set_health(self, ready: bool) -> None:
        status = _SERVING if ready and not self._draining else _NOT_SERVING
        for service in (health.OVERALL_HEALTH, ROUTER_SERVICE):
            await self._health.set(service, status)



def best_peer_hint(chosen: WorkerId, cached_blocks: Mapping[WorkerId, int],
                   peers: Mapping[WorkerId, tuple[str, int, int]], max_blocks: int) -> PeerHint | None:
    """The worker other than `chosen` holding the most leading prompt blocks (at most
    `max_blocks` count), if it holds more than `chosen` and both are ranks of one transfer
    group (`peers`: worker id → (address, rank, world_size)); ties go to the lowest id."""
    me = peers.get(chosen)
    if me is None:
        return None
    own = min(cached_blocks.get(chosen, 0), max_blocks)
    best: PeerHint | None = None
    for worker_id in sorted(cached_blocks):
        peer = peers.get(worker_id)
        if worker_id == chosen or peer is None or peer[2] != me[2] or peer[1] == me[1]:
            continue
        n = min(cached_blocks[worker_id], max_blocks)
        if n > own and (best is None or n > best.num_blocks):
            best = PeerHint(worker_id, peer[0], peer[1], n)
    return best


# -- `kvmesh router` ----------------------------------------------------------------------
def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (gRPC and HTTP)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = a free port)")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0 = a free port)")
    p.add_argument("--no-http", action="store_true", help="serve no HTTP")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT", help="a worker (repeatable)")
    p.add_argument("--model", default="smollm2", help="the workers' model (for the tokenizer): alias or HF dir")
    p.add_argument("--served-model-name", default=None, help="model id on the HTTP API (default: --model)")
    p.add_argument("--redis-url", default=None, help="metadata Redis (block index)")
    p.add_argument("--cluster-name", default="kvmesh")
    p.add_argument("--routing-policy", default="kv_aware", choices=ROUTING_POLICIES,
                   help="how a request picks its worker (see README: Routing)")
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="bounded load: no worker takes more than ceil(c x average) in-flight requests")


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Prints one stdout line once bound:
    `kvmesh router serving grpc on <host>:<port> http on <host>:<port>` (health says when a
    worker is ready); logs go to stderr."""
    from worker.cli import CLIError, flagify
    try:
        cfg = RouterConfig(worker_addresses=tuple(args.worker), host=args.host, grpc_port=args.grpc_port,
                           http_port=None if args.no_http else args.http_port, model=args.model,
                           served_model_name=args.served_model_name,
                           redis_url=args.redis_url, cluster_name=args.cluster_name,
                           routing_policy=args.routing_policy, load_factor=args.load_factor)
    except ValueError as e:
        raise CLIError(flagify(str(e)).replace("--worker-addresses", "--worker")) from None
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve_until_signal(cfg))


async def _serve_until_signal(cfg: RouterConfig) -> int:
    from worker.cli import CLIError
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = RouterServer(cfg)
    try:
        try:
            grpc_port, http_port = await server.start()
        except RouterStartError as e:
            raise CLIError(f"--{'model' if e.field == 'model' else 'worker'}: {e}") from None
        except (RuntimeError, OSError) as e:
            raise CLIError(f"--grpc-port/--http-port: cannot bind on {cfg.host}: {e}") from None
        http = f"http on {cfg.host}:{http_port}" if http_port is not None else "http off"
        print(f"kvmesh router serving grpc on {cfg.host}:{grpc_port} {http}", flush=True)
        await stop.wait()
        log.info("kvmesh router: signal received, shutting down")
    finally:
        await server.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0
