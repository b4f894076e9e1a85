"""`RouterServer` wires one router process: config → tokenizer → worker registry → routing
core (router/routing/core.py) → fronts (gRPC: router/fronts/grpc_front.py; OpenAI HTTP: router/fronts/openai/app.py);
and `kvmesh router`'s `run_router` (its flags: router/flags.py).

The tokenizer comes from `--model`'s dir (`--tokenizer-source local`) or from the first ready
worker (`worker`: router/workers/tokenizer.py); readiness (HTTP /health and /readyz, gRPC health
of the Router service) needs a ready worker and the tokenizer, and not draining. Liveness (HTTP
/live and /livez, gRPC health of contracts.health.LIVENESS_SERVICE) is up while the loop runs.

The pieces: the core routes and knows no server; the registry probes workers and follows
Redis; each front depends on the core only. This module owns their start and stop order.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import Iterable

from contracts.logs import configure_logging
from contracts.models import ModelLocateError, ModelNotPrepared, find_model_dir
from contracts.tokenizer import ModelTokenizer, TokenizerError
from kvstore.metadata.registry import RedisConfig
from router.config import RouterConfig, TokenizerSource
from router.flags import router_config_from_args
from router.fronts.grpc_front import GrpcFront
from router.fronts.openai.app import HttpFrontend
from router.fronts.openai.openapi import add_openapi_route
from router.fronts.openai.vllm_fields import generation_default_temperature
from router.heap import freeze_startup_heap
from router.observe.metrics import RouterMetrics
from router.observe.picklog import PickLog
from router.routing.core import Router
from router.routing.errors import RouterStartError
from router.routing.replicas import SharedPending
from router.security.auth import warn_if_open
from router.workers.registry import WorkerRegistry
from router.workers.tokenizer import LoadedTokenizer, WorkerTokenizer, resolve_tokenizer_source

log = logging.getLogger("kvmesh.router")
# Converting the GGUF model once (in a child process) takes ~25 s; a bound, not a guess.
_PREPARE_TIMEOUT_S = 600


class RouterServer:
    """Owns the registry, the core and the fronts of one router; `core` is what requests go
    through (tests and the bench call `core.prepare` / `core.generate` directly)."""

    def __init__(self, cfg: RouterConfig, tokenizer: ModelTokenizer | None = None) -> None:
        self.cfg = cfg
        self.registry = WorkerRegistry(cfg, self._on_ready)
        self.core = Router(cfg, self.registry, tokenizer)
        self.metrics = RouterMetrics(self.core)      # served on the HTTP port's /metrics
        self.core.observer = self.metrics
        self.pick_log = PickLog(self.metrics, self.core, cfg.pick_log) if cfg.pick_log else None
        if self.pick_log is not None:
            self.core.observer = self.pick_log
        self._grpc = GrpcFront(self.core)
        self._http: HttpFrontend | None = None
        self._stopped = False
        self.shared: SharedPending | None = None     # --share-pending (router/routing/replicas.py)
        self.tokenizer_source = resolve_tokenizer_source(cfg.tokenizer_source, cfg.model)
        self._fetch: WorkerTokenizer | None = None
        self._tokenizer_ready = asyncio.Event()
        if tokenizer is not None:
            self._tokenizer_ready.set()
        if self.tokenizer_source is TokenizerSource.WORKER and tokenizer is None:
            self._fetch = WorkerTokenizer(cfg, self.registry, self._tokenizer_loaded)
            self.registry.strict_tokenizer = True     # a worker without the digest cannot be checked
            self.registry.on_forget = self._forget_tokenizer

    async def start(self) -> tuple[int, int | None]:
        """Bind, probe the workers once, then keep probing; returns (grpc_port, http_port).

        Raises RouterStartError when the workers that answered disagree on block hashing
        (hash_salt_hex, block_size, vocab_size) or the model has no tokenizer (source local).
        Health turns SERVING as soon as one worker is ready and the tokenizer is loaded
        (`wait_ready`); with the tokenizer from a worker, it is fetched once one is ready.
        """
        if self.tokenizer_source is TokenizerSource.LOCAL:
            if self.core.tokenizer is None:
                self.core.tokenizer = _load_tokenizer(self.cfg.model)
            self.core.default_temperature = generation_default_temperature(self.cfg.model)
            self._tokenizer_ready.set()
        log.info("kvmesh router: tokenizer from %s", "the model dir of --model" if self._fetch is None
                 else "the first ready worker (GetTokenizer)")
        grpc_port = await self._grpc.start(self.cfg.host, self.cfg.grpc_port)
        http_port = None
        try:
            if self.cfg.http_port is not None:
                self._http = HttpFrontend(self.core)
                self.metrics.add_routes(self._http.app)
                add_openapi_route(self._http.app, self._http.model_name)
                http_port = await self._http.start(self.cfg.host, self.cfg.http_port)
            errors = await self.registry.start()
            if errors:
                raise RouterStartError("; ".join(errors), "worker_addresses")
            if self.cfg.share_pending and self.cfg.redis_url is not None:
                self.shared = SharedPending(RedisConfig(url=self.cfg.redis_url, cluster_name=self.cfg.cluster_name),
                                            self.core.prefills, self.registry.index)
                self.shared.start()
        except BaseException:
            await self.stop(0)
            raise
        self.registry.run()
        return grpc_port, http_port

    async def wait_ready(self, timeout: float) -> None:
        """Until at least one worker is ready and the tokenizer is loaded; raises TimeoutError."""
        async def ready() -> None:
            await self.registry.wait_ready(timeout)
            await self._tokenizer_ready.wait()
        await asyncio.wait_for(ready(), timeout)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, let in-flight streams finish for `grace` s, close everything
        (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self.core.draining = True
        await self._grpc.set_health(False)
        # HTTP stays open (its /health says 503) until the gRPC streams have drained too
        await asyncio.gather(self._http.drain(grace) if self._http is not None else asyncio.sleep(0),
                             self._grpc.stop(grace))
        if self._http is not None:
            await self._http.stop(0)
        if self._fetch is not None:
            await self._fetch.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.registry.stop()
        if self.pick_log is not None:
            self.pick_log.close()

    def set_workers(self, addresses: Iterable[str]) -> None:
        """Replace the worker set (on the router's loop); see `WorkerRegistry.set_workers`."""
        self.registry.set_workers(addresses)

    async def _on_ready(self, ready: bool) -> None:
        if ready and self._fetch is not None:
            self._fetch.wake()
        await self._grpc.set_health(ready and self.core.tokenizer is not None)

    def _forget_tokenizer(self) -> None:
        """No worker is ready (registry `on_forget`): the tokenizer goes with the reference model;
        the next ready worker's is loaded (from the cache when it is the same)."""
        assert self._fetch is not None
        self._fetch.forget()
        self.core.tokenizer = None
        self._tokenizer_ready.clear()

    async def _tokenizer_loaded(self, loaded: LoadedTokenizer) -> None:
        self.core.tokenizer = loaded.tokenizer
        self.core.default_temperature = loaded.default_temperature
        self._tokenizer_ready.set()
        await self._grpc.set_health(self.registry.ready)


def _load_tokenizer(model: str) -> ModelTokenizer:
    """The model's tokenizer. A GGUF (alias) not converted yet is converted by a child
    `python -m worker.model.loader prepare`, so the router process never imports torch."""
    try:
        try:
            model_dir = find_model_dir(model)
        except ModelNotPrepared:
            _prepare_in_child(model)
            model_dir = find_model_dir(model)
        return ModelTokenizer.from_model_dir(model_dir)
    except (ModelLocateError, OSError, TokenizerError) as e:
        raise RouterStartError(f"model {model!r}: {e}", "model") from None


def _prepare_in_child(model: str) -> None:
    argv = [sys.executable, "-m", "worker.model.loader", "prepare", "--no-progress", model]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_PREPARE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RouterStartError(f"model {model!r}: conversion took over {_PREPARE_TIMEOUT_S} s", "model") from None
    if done.returncode != 0:
        raise RouterStartError(f"model {model!r}: {done.stderr.strip() or 'conversion failed'}", "model")


# -- `kvmesh router` ----------------------------------------------------------------------
def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Prints one stdout line once bound:
    `kvmesh router serving grpc on <host>:<port> http on <host>:<port>` (health says when a
    worker is ready); logs go to stderr."""
    from contracts.cli import CLIError, flagify
    try:
        cfg = router_config_from_args(args)
    except ValueError as e:
        message = flagify(str(e)).replace("--worker-addresses", "--worker").replace("--api-keys:", "--api-key:")
        raise CLIError(message) from None
    configure_logging(args.log_format)
    warn_if_open(cfg.host, cfg.api_keys)
    return asyncio.run(_serve_until_signal(cfg))


async def _serve_until_signal(cfg: RouterConfig) -> int:
    from contracts.cli import CLIError
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
        log.info("kvmesh router: %d start-up objects frozen out of the collector's passes", freeze_startup_heap())
        http = f"http on {cfg.host}:{http_port}" if http_port is not None else "http off"
        print(f"kvmesh router serving grpc on {cfg.host}:{grpc_port} {http}", flush=True)
        await stop.wait()
        log.info("kvmesh router: signal received: not ready; draining open streams (up to %.0f s)",
                 cfg.drain_timeout_s)
    finally:
        await server.stop(cfg.drain_timeout_s)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0
