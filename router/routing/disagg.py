"""Disaggregated serving: a request's prompt computed on a prefill-role worker, its KV blocks
handed to the decode worker over the peer plane, the tokens streamed by the decode worker.

On whenever the live workers include both a prefill and a decode worker (`kvmesh worker
--role`); a cluster of mixed workers routes exactly as without this module. Per request, after
the core picked the decode worker (its pool: decode and mixed workers, `router.routing.types.decode_pool`):

1. `plan`: hop or skip. Skipped (and counted by reason, `SkipReason`): a prompt shorter than
   `disagg_min_prompt_tokens` (default: where the hop's TTFT starts to beat computing the prompt
   on the decode worker at its step budget, `kvmesh bench disagg`'s `skip_crossover`), a prompt
   whose uncached part on the decode worker is shorter (it holds the rest, or a peer sends it),
   a request asking for prompt logprobs, and workers without a peer plane. Otherwise the
   prefill workers to try are the routing policy's pick over the prefill pool (prefix overlap
   and queue, the same scorers) and its next pick.
2. `hand_off`: the prefill worker gets the request as `prefill_only` (it computes the prompt in
   chunks, keeps each chunk's full blocks cached as it completes, reports each chunk, answers a
   final response and samples nothing). At its first response the decode worker gets the
   request with a `handoff` peer hint naming the prefill worker, while the router follows the
   prefill stream to its end (`_follow`): the decode worker fetches the blocks in rounds as the
   prefill worker stores them (worker/peer/handoff.py: authenticated, checksummed), so the
   transfer overlaps the prefill; it admits the request with them, computes the last prompt
   token and samples the first token itself — one worker owns all sampling state (seeded
   generator, penalties, logprobs), and the output is the mixed worker's, greedy or not.
3. Bounds, on progress: a prefill worker tried must report its first chunk within
   `disagg_transfer_timeout_s`, and then each next chunk within that again (`_follow`); the hint
   carries the same bound for the decode worker, whose fetch ends when no new block came for that
   long (worker/peer/handoff.py). A long prompt on a slow worker thus takes as long as its prefill
   takes, while a worker that stalls costs at most the bound after its last progress. A prefill
   worker that dies (UNAVAILABLE: marked down), stalls or fails before its first chunk is replaced
   by the plan's next one (`MAX_PREFILL_TRIES`); with none left, or when it fails after the hint
   went out, the decode worker computes what did not arrive: the request is never lost.

torch-free; the only gRPC here is the call to the prefill worker.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import NamedTuple

import grpc

from contracts.logs import REQUEST_ID_HEADER
from contracts.requests import PeerHint
from contracts.roles import WorkerRole
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.policy import Policy
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerInfo
from router.workers.registry import WorkerEntry, WorkerRegistry

log = logging.getLogger("kvmesh.router")

MIN_FETCH_S = 0.05   # a hint with less of the hop's time left is not sent: the decode worker computes
MAX_PREFILL_TRIES = 2   # prefill workers a hop tries before the decode worker computes the prompt


class SkipReason(enum.Enum):
    """Why a request of a disaggregated cluster skipped the prefill hop (a metric label)."""

    SHORT = "short"                     # prompt shorter than disagg_min_prompt_tokens
    CACHED = "cached"                   # its uncached part on the decode worker is shorter than that
    PROMPT_LOGPROBS = "prompt_logprobs"  # every prompt position's logits are wanted on the decode worker
    NO_PEER_PLANE = "no_peer_plane"     # the decode worker or every prefill worker lacks a peer plane
    NO_PREFILL_WORKER = "no_prefill_worker"   # the policy picked none (all excluded)


class FailCause(enum.Enum):
    """Why a prefill worker failed a hop (a metric label)."""

    UNAVAILABLE = "unavailable"   # the prefill worker's call failed as unreachable (dead, restarting)
    TIMEOUT = "timeout"           # its deadline (disagg_transfer_timeout_s) passed: stalled or too slow
    ERROR = "error"               # it answered an error, or closed its stream unfinished
    NO_TIME_LEFT = "no_time_left"  # prefilled, but too little of the hop's time remains for the fetch


class DisaggObserver:
    """What the hop tells a metrics layer (router/observe/metrics.py); this base is the null
    observer. Called on the router's loop; must not block."""

    def hop_skipped(self, reason: SkipReason) -> None:
        """A request of a disaggregated cluster went to its decode worker without the hop."""

    def hop_prefilled(self, prefill_worker_id: str, seconds: float) -> None:
        """The prefill worker computed the prompt in `seconds` (its final response)."""

    def hop_failed(self, prefill_worker_id: str, cause: FailCause) -> None:
        """A prefill worker failed the hop: before the hint went out (the next one is tried, or
        the decode worker computes the prompt) or after (the decode worker computes what did
        not arrive)."""


class HopPlan(NamedTuple):
    """A planned hop: the prefill workers to try in turn (the policy's pick, then its next
    pick) and the full prompt blocks the decode worker is to fetch (all but the last prompt
    token's, which the decode worker computes)."""

    prefills: tuple[WorkerEntry, ...]
    num_blocks: int


def roles_present(workers: Sequence[WorkerInfo]) -> frozenset[WorkerRole]:
    return frozenset(w.role for w in workers)


def is_active(workers: Sequence[WorkerInfo]) -> bool:
    """Disaggregated serving is on: the live workers include a prefill and a decode worker."""
    roles = roles_present(workers)
    return WorkerRole.PREFILL in roles and WorkerRole.DECODE in roles


def skip_reason(prompt_tokens: int, cached_tokens: int, min_prompt_tokens: int,
                prompt_logprobs: bool) -> SkipReason | None:
    """Why a request skips the hop on these figures (None: it takes it). `cached_tokens`: prompt
    tokens the decode worker holds or will fetch from a peer anyway."""
    if prompt_logprobs:
        return SkipReason.PROMPT_LOGPROBS
    if prompt_tokens < min_prompt_tokens:
        return SkipReason.SHORT
    if prompt_tokens - cached_tokens < min_prompt_tokens:
        return SkipReason.CACHED
    return None


class Disaggregation:
    """The prefill hop of one router (see the module docstring). `observer` is replaced by the
    router's metrics."""

    def __init__(self, registry: WorkerRegistry, min_prompt_tokens: int, transfer_timeout_s: float) -> None:
        self.registry = registry
        self.min_prompt_tokens = min_prompt_tokens
        self.transfer_timeout_s = transfer_timeout_s
        self.observer = DisaggObserver()
        self.handoffs = 0          # hops whose hint went to the decode worker
        self.skips = 0
        self.failures = 0
        self._following: dict[str, asyncio.Task[None]] = {}   # request id -> its prefill, read to its end

    def plan(self, workers: Sequence[WorkerInfo], policy: Policy, route: RouteRequest, state: RoutingState,
             peers: Mapping[WorkerId, str], decode_id: WorkerId, cached_tokens: int, prompt_logprobs: bool,
             block_size: int) -> HopPlan | None:
        """The hop for a request whose decode worker is `decode_id` (holding or fetching anyway
        `cached_tokens` of the prompt), or None: off (not a disaggregated cluster) or skipped
        (counted). `peers`: the workers with a peer plane."""
        if not is_active(workers):
            return None
        reason = skip_reason(len(route.token_ids), cached_tokens, self.min_prompt_tokens, prompt_logprobs)
        pool = [w for w in workers if w.role is WorkerRole.PREFILL and w.worker_id in peers]
        if reason is None and (decode_id not in peers or not pool):
            reason = SkipReason.NO_PEER_PLANE
        picks: list[WorkerInfo] = []
        while reason is None and len(picks) < MAX_PREFILL_TRIES:
            chosen = policy.pick(pool, route, state, exclude={w.worker_id for w in picks})
            if chosen is None:
                break
            picks.append(chosen)
        if reason is None and not picks:
            reason = SkipReason.NO_PREFILL_WORKER
        if reason is not None:
            self.skip(reason)
            return None
        return HopPlan(tuple(self.registry.entry(w.address) for w in picks), (len(route.token_ids) - 1) // block_size)

    def skip(self, reason: SkipReason) -> None:
        self.skips += 1
        self.observer.hop_skipped(reason)

    async def hand_off(self, rid: str, request: pb.GenerateRequest, plan: HopPlan,
                       deadline: float) -> PeerHint | None:
        """Start the prompt on the plan's prefill workers in turn until one reports its first
        chunk; the hand-off hint for the decode worker (the prefill goes on, followed by a task
        until its final response), or None when the decode worker is to compute the prompt
        itself (every try failed, counted)."""
        for entry in plan.prefills:
            if entry.info is None or time.monotonic() >= deadline:   # marked down since the plan
                continue
            hint = await self._try(rid, request, entry, plan.num_blocks,
                                   min(deadline, time.monotonic() + self.transfer_timeout_s), deadline)
            if hint is not None:
                self.handoffs += 1
                return hint
        return None

    async def _try(self, rid: str, request: pb.GenerateRequest, entry: WorkerEntry, num_blocks: int,
                   hop_deadline: float, request_deadline: float) -> PeerHint | None:
        """One prefill worker: the hint once its first response (a chunk computed, or the final
        one) came before `hop_deadline`, or None (the failure counted)."""
        assert entry.info is not None
        prefill_id = entry.info.worker_id
        started = time.monotonic()
        message = pb.GenerateRequest()
        message.CopyFrom(request)
        message.request_id = f"{rid}:prefill"
        message.prefill_only = True
        del message.peer_hints[:]
        entry.in_flight += 1
        # the call lasts as long as the request may; progress is bounded chunk by chunk
        call = entry.stub.Generate(message, timeout=max(request_deadline - started, 0.001),
                                   metadata=((REQUEST_ID_HEADER, rid),))
        responses = aiter(call)
        following = False
        try:
            try:
                first = await asyncio.wait_for(anext(responses), max(hop_deadline - started, 0.001))
            except TimeoutError:
                self._failed(rid, prefill_id, FailCause.TIMEOUT,
                             f"no prefill chunk in {self.transfer_timeout_s:.1f} s")
                return None
            if first.finished:
                self.observer.hop_prefilled(prefill_id, time.monotonic() - started)
            left = hop_deadline - time.monotonic()
            if left < MIN_FETCH_S:
                self._failed(rid, prefill_id, FailCause.NO_TIME_LEFT, "prefilled too late")
                return None
            if not first.finished:
                task = asyncio.create_task(self._follow(rid, entry, call, responses, started))
                self._following[rid] = task
                following = True
            return PeerHint(prefill_id, entry.address, num_blocks, handoff=True, timeout_s=self.transfer_timeout_s)
        except StopAsyncIteration:
            self._failed(rid, prefill_id, FailCause.ERROR, "closed its stream without a response")
        except grpc.aio.AioRpcError as e:
            self._failed(rid, prefill_id, self._cause(entry, e), f"{e.code().name}: {e.details()}")
        finally:
            if not following:
                entry.in_flight -= 1
                call.cancel()    # the request went away mid-hop, or it is over: the prefill worker aborts it
        return None

    async def _follow(self, rid: str, entry: WorkerEntry, call: grpc.aio.UnaryStreamCall,
                      responses: AsyncIterator[pb.GenerateResponse], started: float) -> None:
        """Read a prefill worker's stream to its final response, while the decode worker fetches
        the blocks; a failure now costs the decode worker what did not arrive (it computes it)."""
        assert entry.info is not None
        prefill_id = entry.info.worker_id
        finished = False
        try:
            while not finished:
                try:
                    response = await asyncio.wait_for(anext(responses), self.transfer_timeout_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    self._failed(rid, prefill_id, FailCause.TIMEOUT,
                                 f"no prefill chunk in {self.transfer_timeout_s:.1f} s")
                    return
                finished = response.finished
            if finished:
                self.observer.hop_prefilled(prefill_id, time.monotonic() - started)
            else:
                self._failed(rid, prefill_id, FailCause.ERROR, "closed its stream unfinished")
        except grpc.aio.AioRpcError as e:
            self._failed(rid, prefill_id, self._cause(entry, e), f"{e.code().name}: {e.details()}")
        finally:
            entry.in_flight -= 1
            call.cancel()
            self._following.pop(rid, None)

    def release(self, rid: str) -> None:
        """The request is over (finished, failed or cancelled): stop following its prefill."""
        task = self._following.pop(rid, None)
        if task is not None and not task.done():
            task.cancel()

    def _cause(self, entry: WorkerEntry, e: grpc.aio.AioRpcError) -> FailCause:
        code = e.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return FailCause.TIMEOUT
        if code is grpc.StatusCode.UNAVAILABLE:
            self.registry.mark_down(entry, e.details() or "")
            return FailCause.UNAVAILABLE
        return FailCause.ERROR

    def _failed(self, rid: str, prefill_id: str, cause: FailCause, why: str) -> None:
        log.warning("request %s: prefill on %s failed (%s: %s)", rid, prefill_id, cause.value, why)
        self.failures += 1
        self.observer.hop_failed(prefill_id, cause)
