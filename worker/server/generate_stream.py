"""One `Generate` call on a worker: the message → the request spec (contracts `GenerateInput`,
built once here and passed down to `Engine.add_request`) → a peer fetch of the hinted prefix
(with peer transfer on) → the engine's outputs → `GenerateResponse` messages, the
last with the usage figures.

A hint with `handoff` set (disaggregated serving, router/routing/disagg.py) names the prefill
worker computing this prompt: its blocks are fetched in rounds as it stores them, without
asking the cost model, within the hint's `timeout_s` (worker/peer/handoff.py) — past it, or when
a round fails, the request computes what did not arrive here (the same tokens). A
`prefill_only` request reports each prefill chunk (`prefilled_tokens`, no tokens) and finishes
once its prompt is computed (a final response with no tokens). Feeds the worker's metrics and its
running token totals (GetLoad).
worker/server/service.py owns the call (readiness, draining, liveness, status codes); this module only
streams. Torch-free at import.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

from contracts.logs import REQUEST_ID, trace_id
from contracts.wire import to_generate_input
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.engine.commands import ApplyChatTemplate, Tokenize
from worker.peer.errors import FetchFailure
from worker.server.responses import stream_response

if TYPE_CHECKING:
    from collections.abc import Sequence

    from contracts.requests import GenerateInput, PeerHint
    from worker.engine.async_engine import AsyncEngine
    from worker.engine.request import RequestOutput
    from worker.peer.config import AskPeer, Fetched
    from worker.peer.plane import PeerPlane
    from worker.server.metrics import WorkerMetrics

log = logging.getLogger("kvmesh.worker")


class GenerateStreams:
    """The Generate path of one worker. `peer`, `metrics` and `block_size` are set by the
    server once its engine is loaded; `prompt_tokens` / `cached_prompt_tokens` are running
    totals over the final messages sent. Used on the server's event loop only."""

    def __init__(self, worker_id: str, ask: AskPeer) -> None:
        self.worker_id = worker_id
        self._ask = ask                      # the control-plane call of a peer fetch
        self.peer: PeerPlane | None = None
        self.metrics: WorkerMetrics | None = None
        self.block_size = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.prefill_only_requests = 0

    async def run(self, ae: AsyncEngine, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Serve one Generate call to its end (errors propagate to the server, which maps them)."""
        spec = to_generate_input(msg)
        spec = replace(spec, request_id=spec.request_id or uuid.uuid4().hex)
        REQUEST_ID.set(trace_id(context, spec.request_id))   # on every log line of this request
        fetched = None
        if spec.peer_hints and self.peer is not None:
            spec = await _with_token_ids(ae, spec)   # the fetch plan hashes the prompt's blocks
            assert spec.token_ids is not None
            handoff = next((h for h in spec.peer_hints if h.handoff), None)
            if handoff is not None:
                fetched = await self._handoff(ae, self.peer, spec.token_ids, handoff, spec.cache_salt)
            else:
                fetched = await self.peer.fetch(ae, spec.token_ids, spec.peer_hints, self._ask, spec.cache_salt)
        outputs = ae.generate(spec, staged=fetched.staged if fetched is not None else None)
        t0, first = time.perf_counter(), True
        gaps = self.metrics.token_gaps() if self.metrics is not None else None
        completion_tokens = 0          # over every sequence (n / best_of)
        finished = False
        try:
            async for out in outputs:
                if gaps is not None:
                    gaps.output(out)
                progress = spec.prefill_only and not out.finished   # one prefill chunk computed
                if first and not progress and self.peer is not None:
                    self.peer.observe_prefill(out.prompt_tokens - out.num_cached_tokens, time.perf_counter() - t0)
                first = first and progress
                completion_tokens += out.completion_tokens if out.finished else 0
                response = self.response(out, fetched, completion_tokens)
                finished = response.finished
                if finished and spec.prefill_only:
                    self.prefill_only_requests += 1
                    if self.metrics is not None:
                        self.metrics.observe_prefill_only()
                await context.write(response)
        except asyncio.CancelledError:
            if not finished:          # the caller cancelled mid-stream: counted as an abort, one line
                if self.metrics is not None:
                    self.metrics.observe_aborted()
                log.info("request %s aborted on %s: the caller cancelled it", spec.request_id, self.worker_id)
            raise
        finally:
            # Client cancelled or deadline passed (CancelledError here): closing the iterator
            # aborts the request and frees its blocks.
            await outputs.aclose()

    async def _handoff(self, ae: AsyncEngine, peer: PeerPlane, token_ids: Sequence[int], hint: PeerHint,
                       cache_salt: str) -> Fetched | None:
        """Fetch the prompt's blocks from the prefill worker `hint` names as it stores them, within
        its timeout (worker/peer/handoff.py)."""
        from worker.peer.handoff import fetch_streamed  # torch: only on a worker with a peer plane
        failures: list[FetchFailure] = []
        t0 = time.perf_counter()
        fetched = await fetch_streamed(peer, ae, token_ids, hint, self._ask, cache_salt, on_failed=failures.append)
        if failures:
            log.warning("hand-off from %s ended short (%s: %s); computing the rest of the prompt here",
                        hint.worker_id, failures[-1].cause.value, failures[-1].why)
        if self.metrics is not None:
            if fetched is not None:
                self.metrics.observe_handoff(fetched.num_blocks * peer.spec.bytes_per_block, time.perf_counter() - t0)
            for failure in failures:
                self.metrics.observe_handoff_failed(failure.cause.value)
        return fetched

    def response(self, out: RequestOutput, fetched: Fetched | None = None,
                 completion_tokens: int = 0) -> pb.GenerateResponse:
        resp = stream_response(out, self.worker_id)
        resp.prefilled_tokens = out.prefilled_tokens
        if out.finished and out.group_finished:
            resp.finished = True
            resp.prompt_tokens = out.prompt_tokens
            resp.completion_tokens = max(completion_tokens, out.completion_tokens)
            resp.cached_tokens = out.num_cached_tokens
            if fetched is not None:   # the fetched blocks follow the local ones, if admission used them
                bs = self.block_size
                resp.peer_cached_tokens = min(max(out.num_cached_tokens - fetched.num_local * bs, 0),
                                              fetched.num_blocks * bs)
            self.prompt_tokens += out.prompt_tokens
            if self.metrics is not None:
                self.metrics.observe_finished(out, resp.completion_tokens)
            t = out.timings
            log.info("request %s finished on %s: prompt_tokens=%d cached_tokens=%d completion_tokens=%d "
                     "ttft_s=%.4f e2e_s=%.4f finish_reason=%s", out.request_id, self.worker_id,
                     out.prompt_tokens, out.num_cached_tokens, out.completion_tokens, t.ttft_s or 0.0,
                     t.e2e_s or 0.0, out.finish_reason)
            self.cached_prompt_tokens += out.num_cached_tokens
        return resp


async def _with_token_ids(ae: AsyncEngine, spec: GenerateInput) -> GenerateInput:
    """`spec` with its text or chat prompt turned into token ids on the engine thread (without
    a peer fetch to plan, the engine does that itself when it adds the request)."""
    if spec.chat is not None:
        ids = await ae.run(ApplyChatTemplate(tuple((m.role, m.content) for m in spec.chat)))
    elif spec.text is not None:
        ids = await ae.run(Tokenize(spec.text))
    else:
        return spec
    return replace(spec, text=None, chat=None, token_ids=tuple(ids))
