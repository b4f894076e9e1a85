"""The routing core: `Router` takes a validated request (contracts `GenerateInput`) through
prepare (tokenize, range-check, chained block hashes) → pick (the policy over the live
workers, the block index and the router's in-flight counts) → generate (stream from the
chosen worker; a worker lost mid-stream: migrate, router/routing/migrate.py) → abort. The
routing view and the pick are router/routing/pick.py; what the core reports,
router/routing/observer.py; the prefill hop of disaggregated serving, router/routing/disagg.py.

No gRPC servicer and no HTTP here: the fronts (router/fronts/grpc_front.py, router/fronts/openai/app.py) call
this and map its exceptions (router/routing/errors.py) to their status codes. The only gRPC in
this module is the client call to a worker. torch-free.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import replace
from typing import NamedTuple

import grpc

from contracts.logs import REQUEST_ID, REQUEST_ID_HEADER
from contracts.requests import BadRequest, GenerateInput, TenantShare
from contracts.tokenizer import ModelTokenizer, TokenizerError
from contracts.wire import from_sampling_params, to_tenant_share
from kvstore.keys import block_hashes, cache_salt_root
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.routing.disagg import Disaggregation
from router.routing.errors import NoWorkerAvailable, TokenizerNotLoaded, UpstreamError
from router.routing.fastpick import KvAwareFast
from router.routing.inflight import InFlightPrefills
from router.routing.migrate import (
    MAX_WAIT_FOR_WORKER_S,
    Progress,
    WorkerLost,
    is_migratable,
    log_migration,
    read_until_lost,
)
from router.routing.observer import RouteObserver, RoutingStats
from router.routing.pick import (
    Pick,
    RoutingView,
    as_listed,
    discount_view,
    pick_reference,
    pick_worker,
    reference_view,
    routing_view,
    with_hint,
)
from router.routing.policy import Policy, make_policy
from router.routing.predictions import HitPredictions
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo, decode_pool
from router.security.auth import ANONYMOUS, ApiKey, TenantId
from router.security.bounds import PromptBounds
from router.security.tenancy import TenantActivity, TenantSalts, bound_max_tokens
from router.workers.registry import WorkerEntry, WorkerRegistry

log = logging.getLogger("kvmesh.router")


class Prepared(NamedTuple):
    """A validated request, ready to forward: the worker-bound message, what routing sees and
    the tenant that sent it (only that tenant may abort it)."""

    request: pb.GenerateRequest
    route: RouteRequest
    tenant: TenantId = ANONYMOUS.tenant


class _Failed(Exception):
    """One attempt's worker is gone (the message says how); the request may move on."""


class Router:
    """Routes requests over `registry` (its live workers and its block index) with the
    policy `cfg.routing_policy`. Runs on one event loop; owns the in-flight table (request
    id → worker) and the in-flight counts the policy reads."""

    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, tokenizer: ModelTokenizer | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.policy: Policy = make_policy(cfg.routing_policy, cfg.load_factor)
        self._fast: KvAwareFast | None = None
        # False: the dict state and Policy.pick (the reference; `kvmesh bench scale`'s baseline)
        self.column_pick = True
        self._fast_of: Policy | None = None
        self.stats = RoutingStats()
        self.observer = RouteObserver()   # replaced by RouterServer with its RouterMetrics
        self.tokenizer = tokenizer      # set by whoever starts the router, before it serves
        self.default_temperature = 1.0  # the model's generation_config.json (vLLM's default), set with it
        self._inflight: dict[str, WorkerEntry | None] = {}
        self._owners: dict[str, TenantId] = {}   # request id -> the tenant that sent it
        self.salts = TenantSalts(cfg.api_keys)
        self.tenants = TenantActivity()      # busy tenants, stamped on each request (router/security/tenancy.py)
        self.bounds = PromptBounds()         # the prompt bound and the tokenization pool (router/security/bounds.py)
        self.draining = False
        self.prefills = InFlightPrefills()   # pending blocks and prefill queues
        self.predictions = HitPredictions()  # predicted vs served hits per worker; corrects the index
        self.disagg = Disaggregation(registry, cfg.disagg_min_prompt_tokens, cfg.disagg_transfer_timeout_s)

    @property
    def model_info(self) -> pb.ModelInfo | None:
        """What the ready workers serve (None until one was ready)."""
        return self.registry.model_info

    @property
    def serving(self) -> bool:
        """Ready: a worker is ready, the tokenizer is loaded, not draining."""
        return self.registry.ready and self.tokenizer is not None and not self.draining

    def live_workers(self) -> list[WorkerInfo]:
        return [w.info for w in self.registry.live() if w.info is not None]

    async def prepare(self, inp: GenerateInput, caller: ApiKey = ANONYMOUS) -> Prepared:
        """Refuse a prompt longer in characters than the context can hold (router/security/bounds.py),
        tokenize on the bounded pool beside the loop and validate; raises BadRequest, or
        NoWorkerAvailable before any worker has told the router its model.
        `caller` (the authenticated key) decides the default cache_salt (router/security/tenancy.py)."""
        info, tok = self.model_info, self.tokenizer
        if self.draining:
            raise NoWorkerAvailable("the router is draining (shutting down)")
        if info is None:
            raise NoWorkerAvailable("no worker is ready")
        if tok is None:
            raise TokenizerNotLoaded()
        await self.bounds.check(inp, info.max_model_len, tok)     # before tokenizing
        try:
            if inp.text is not None:
                ids = await self.bounds.run(tok.encode, inp.text)
            elif inp.chat is not None:
                messages = [{"role": m.role, "content": m.content} for m in inp.chat]
                ids = await self.bounds.run(tok.apply_chat_template, messages)
            else:
                ids = list(inp.token_ids or ())
                bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
                if bad is not None:
                    raise BadRequest(f"token_ids: {bad} is outside the vocabulary [0, {info.vocab_size})")
        except TokenizerError as e:
            raise BadRequest(f"chat: {e}") from None
        if inp.params.truncate_prompt_tokens is not None:
            ids = ids[-inp.params.truncate_prompt_tokens:]  # vLLM: keep the last N
        if not ids:
            raise BadRequest("input: the prompt is empty after tokenization")
        if len(ids) >= info.max_model_len:
            raise BadRequest(f"input: the prompt has {len(ids)} tokens; this model takes at most "
                             f"{info.max_model_len - 1} (max_model_len {info.max_model_len})")
        params = bound_max_tokens(inp, len(ids), info.max_model_len, self.cfg.max_tokens_limit)
        salt = self.salts.salt_for(caller, inp.cache_salt)
        hashes = block_hashes(ids, info.block_size, bytes.fromhex(info.hash_salt_hex), cache_salt_root(salt))
        request = pb.GenerateRequest(request_id=inp.request_id or f"rtr-{uuid.uuid4().hex}",
                                     token_ids=pb.TokenIds(ids=ids), sampling=from_sampling_params(params),
                                     priority=inp.priority, cache_salt=salt,
                                     tenant=to_tenant_share(self._tenant_share(caller)))
        return Prepared(request, RouteRequest(tuple(ids), tuple(hashes)), caller.tenant)

    def _tenant_share(self, caller: ApiKey) -> TenantShare:
        """What the worker learns of `caller`: its share from the keys file and the tenants
        busy on this router now (none of it for the anonymous tenant of a router without keys)."""
        if caller is ANONYMOUS:
            return TenantShare()
        return TenantShare(caller.tenant, caller.weight, caller.max_cached_blocks,
                           self.tenants.busy_with(caller.tenant))

    async def generate(self, prepared: Prepared, timeout: float | None) -> AsyncIterator[pb.GenerateResponse]:
        """Forward to the policy's worker and yield its responses. A worker that dies or
        becomes unreachable is marked down and the request re-submitted to another, with the
        tokens already streamed (router/routing/migrate.py), at most `cfg.migration_limit` times; the
        client's stream goes on. Closing the iterator cancels the upstream call (the worker
        aborts it). Raises BadRequest (request_id in flight), NoWorkerAvailable, UpstreamError."""
        rid = prepared.request.request_id
        REQUEST_ID.set(rid)      # on every log line of this request, and to the worker as metadata
        if rid in self._inflight:
            raise BadRequest(f"request_id {rid!r} is already running")
        deadline = time.monotonic() + (timeout if timeout is not None else self.cfg.request_timeout_s)
        self._inflight[rid] = None
        self._owners[rid] = prepared.tenant
        self.tenants.arrive(prepared.tenant)
        progress = Progress(prepared.request, self.cfg.migration_limit, started=time.perf_counter())
        request, route = prepared.request, prepared.route
        tried: set[WorkerId] = set()
        # The model the request was prepared for; the registry may forget it while no worker is
        # ready (a router whose tokenizer comes from the workers), e.g. while its only worker restarts.
        prepared_for = self.model_info
        worker_id: WorkerId | None = None
        finished = False
        try:
            while True:
                pick = await self._pick_next(route, tried, progress, deadline)
                assert pick.worker.info is not None
                worker_id = pick.worker.info.worker_id   # info may be cleared by a probe while streaming
                tried.add(worker_id)
                self.observer.picked(rid, route, worker_id)
                if not progress.resubmits:   # before its asks are counted (a resubmission keeps it)
                    request.shared_prefix_blocks = self.registry.index.shared_prefix(route.block_hashes)
                    pick = await self._hand_off(rid, request, route, pick, deadline)
                try:
                    attempt_stream = self._attempt(rid, request, route, pick, deadline, progress)
                    async with contextlib.aclosing(attempt_stream) as attempt:
                        async for response in attempt:
                            finished = response.finished
                            yield response
                    return
                except _Failed as f:
                    if not progress.may_resubmit():
                        raise UpstreamError(grpc.StatusCode.UNAVAILABLE,
                                            f"worker {pick.worker.address} {f}") from None
                    if progress.generated:
                        log_migration(rid, worker_id, str(f), progress)
                        self.observer.migrated(rid, worker_id, len(progress.generated))
                info = self.model_info or prepared_for
                if info is None:
                    raise NoWorkerAvailable("no worker is ready")
                request, route = progress.resubmit(info.block_size, bytes.fromhex(info.hash_salt_hex))
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:          # the client cancelled or disconnected mid-request
                self.observer.aborted(rid, worker_id, len(progress.generated))
            raise
        finally:
            self.disagg.release(rid)
            self._inflight.pop(rid, None)
            self._owners.pop(rid, None)
            self.tenants.leave(prepared.tenant)

    def tenant_of(self, request_id: str) -> TenantId | None:
        """The tenant that sent `request_id` while it is in flight (None: not in flight)."""
        return self._owners.get(request_id)

    async def _pick_next(self, route: RouteRequest, tried: set[WorkerId], progress: Progress,
                         deadline: float) -> Pick:
        """The next worker. Mid-stream, with no other worker ready (e.g. the only one is
        restarting), wait for one (any, the failed one included) up to `MAX_WAIT_FOR_WORKER_S`."""
        decided = time.perf_counter()
        try:
            return self.pick(route, tried)
        except NoWorkerAvailable:
            if not progress.generated:
                raise
        finally:
            self.observer.decided(time.perf_counter() - decided)
        until = min(deadline, time.monotonic() + MAX_WAIT_FOR_WORKER_S)
        while time.monotonic() < until:
            await asyncio.sleep(0.2)
            with contextlib.suppress(NoWorkerAvailable):
                return self.pick(route, set())
        raise NoWorkerAvailable("no worker is available (retry failed)")

    async def _attempt(self, rid: str, request: pb.GenerateRequest, route: RouteRequest, pick: Pick,
                       deadline: float, progress: Progress) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Stream `request` from `pick.worker` until its finished response; raises _Failed
        when the worker is gone (its call UNAVAILABLE, its stream cut, its probes failing)."""
        worker = pick.worker
        assert worker.info is not None
        worker_id = worker.info.worker_id
        self._inflight[rid] = worker
        # pending blocks on the pick until its worker stores them (router/routing/inflight.py); a
        # resubmitted request's prompt was counted as evidence of sharing by its first attempt
        self.prefills.dispatched(self.registry.index, rid, worker_id, route,
                                 pick.predicted_tokens + pick.fetched_tokens, resubmitted=progress.resubmits > 0)
        streamed = False
        worker.in_flight += 1
        call = responses = None
        try:
            await self.prefills.wait_for_leaders(rid, deadline - time.monotonic())
            self.stats.peer_hints += pick.hint is not None
            call = worker.stub.Generate(with_hint(request, pick.hint),
                                        timeout=max(deadline - time.monotonic(), 0.001),
                                        metadata=((REQUEST_ID_HEADER, rid),))
            responses = read_until_lost(call, worker.lost)
            async for response in responses:
                if not streamed:
                    streamed = True
                    self.prefills.prefilled(self.registry.index, rid)
                if progress.ttft_s is None:
                    progress.ttft_s = time.perf_counter() - progress.started
                    self.observer.first_response(rid, worker_id, progress.ttft_s)
                progress.note(response)
                if response.finished:
                    if not progress.migrations:   # what came from a peer is no index mismatch
                        served = response.cached_tokens - response.peer_cached_tokens
                        self.stats.record(pick.predicted_tokens, served)
                        self._check_prediction(worker_id, route, pick.predicted_tokens, served)
                    response.migrations = progress.migrations
                    self.observer.finished(rid, worker_id, response, progress.ttft_s,
                                           time.perf_counter() - progress.started)
                    yield response
                    return
                yield response
            # No silent truncation: a stream that ends without a finished response is a failure.
            raise _Failed("closed the stream before it finished")
        except grpc.aio.AioRpcError as e:
            self.observer.failed(rid, worker_id)
            if not is_migratable(e):
                raise UpstreamError(e.code(), e.details() or "") from None
            self.registry.mark_down(worker, e.details() or "")
            raise _Failed(f"became unavailable: {e.details()}") from None
        except WorkerLost as e:
            self.observer.failed(rid, worker_id)
            raise _Failed(f"became unreachable: {e}") from None
        finally:
            worker.in_flight -= 1
            self.prefills.done(self.registry.index, rid, streamed)
            if call is not None:
                call.cancel()
            if responses is not None:
                await responses.aclose()

    def _check_prediction(self, worker_id: WorkerId, route: RouteRequest, predicted: int, served: int) -> None:
        """The hit predicted on `worker_id` against the one served (router/routing/predictions.py); a
        persisting over-prediction drops the stale blocks from the index and asks for an inventory."""
        info = self.model_info
        seen = self.predictions.observe(worker_id, route, predicted, served, info.block_size if info is not None else 0)
        self.observer.hit_predicted(worker_id, seen.error)
        if seen.correction is not None:
            self.registry.index.forget(worker_id, seen.correction.lost)
            self.registry.request_inventory(worker_id)

    async def abort(self, request_id: str, tenant: TenantId | None = None) -> bool:
        """Abort a request in flight on the worker serving it; False when none is, or when
        `tenant` (None: any) is not the tenant that sent it (the same answer: nothing leaks)."""
        worker = self._inflight.get(request_id)
        if worker is None or (tenant is not None and self._owners.get(request_id) != tenant):
            return False
        try:
            response = await worker.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise UpstreamError(e.code(), e.details() or "") from None
        return bool(response.found)

    def routing_state(self, route: RouteRequest) -> RoutingState:
        """The policy's view now: in-flight and KV load per live worker, the leading prompt
        blocks each holds according to the block index (none where no event stream feeds it)
        and those it could fetch from a peer."""
        return self._going_view(route)[0].state

    def _routing_view(self, route: RouteRequest) -> RoutingView:
        info = self.model_info
        return routing_view(self.registry, self.prefills, route, info.block_size if info is not None else None)

    def _going_view(self, route: RouteRequest) -> tuple[RoutingView, Mapping[WorkerId, int]]:
        """The routing view, in which a prefix a worker is evicting (router/routing/going.py)
        counts none of its blocks there, and what the index lists (the hit predicted)."""
        view = self._routing_view(route)
        listed = view.cached
        return discount_view(view, self.prefills.going_less(listed, route)), listed

    def pick(self, route: RouteRequest, tried: set[WorkerId]) -> Pick:
        """The policy's worker (not in `tried`), the prompt tokens the index says it will find
        cached, and the peer to hint when another live worker holds more of the prompt. A
        prefix its worker is evicting does not draw the request there (router/routing/going.py);
        sent there anyway, it is promised what the index lists."""
        info = self.model_info
        bs = info.block_size if info is not None else 0
        picked: Pick | None
        if not self.column_pick:
            ref = reference_view(self.registry, self.prefills, route, bs or None)
            listed = ref.state.cached_blocks
            cached = self.prefills.going_less(listed, route)
            if cached is not listed:
                ref = ref._replace(state=replace(ref.state, cached_blocks={w: cached.get(w, 0) for w in listed}))
            picked = pick_reference(self.policy, self.registry, ref, decode_pool(self.live_workers()), route, tried, bs)
        else:
            view, listed = self._going_view(route)
            cached = view.cached
            picked = pick_worker(self.policy, self.registry, view, view.decode_pool, route, tried, bs,
                                 self.column_picker)
        if picked is None:
            raise NoWorkerAvailable("no worker is available" + (" (retry failed)" if tried else ""))
        return picked if cached is listed else as_listed(picked, listed, route, bs)

    @property
    def column_picker(self) -> KvAwareFast | None:
        """The policy's column pick (router/routing/fastpick.py; None: the policy has none)."""
        if self._fast_of is not self.policy:
            self._fast, self._fast_of = KvAwareFast.of(self.policy), self.policy
        return self._fast

    async def _hand_off(self, rid: str, request: pb.GenerateRequest, route: RouteRequest, pick: Pick,
                        deadline: float) -> Pick:
        """In a disaggregated cluster, the prefill hop before `pick`'s decode worker streams
        (router/routing/disagg.py): `pick` with a hand-off hint, or as it is (hop skipped or failed)."""
        live, info = self.registry.live_columns(), self.model_info
        if not live.disaggregated or pick.worker.info is None or info is None or not info.block_size:
            return pick     # (the common case: no per-worker work per request)
        workers = live.infos
        view = self._routing_view(route)
        plan = self.disagg.plan(workers, self.policy, route, view.state, view.peers, pick.worker.info.worker_id,
                                pick.predicted_tokens + pick.fetched_tokens,
                                request.sampling.HasField("prompt_logprobs"), info.block_size)
        hint = await self.disagg.hand_off(rid, request, plan, deadline) if plan is not None else None
        if hint is None:
            return pick
        fetched = max(0, hint.num_blocks * info.block_size - pick.predicted_tokens)
        return pick._replace(hint=hint, fetched_tokens=fetched)
