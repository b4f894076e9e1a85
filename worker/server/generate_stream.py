"""One `Generate` call on a worker: the prompt (text, chat or token ids) → a peer fetch of the
hinted prefix (with peer transfer on) → the engine's outputs → `GenerateResponse` messages, the
last with the usage figures. Feeds the worker's metrics and its running token totals (GetLoad).
worker/server/service.py owns the call (readiness, draining, liveness, status codes); this module only
streams. Torch-free at import.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc

from contracts.logs import REQUEST_ID, trace_id
from contracts.wire import to_generate_input
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.engine.commands import ApplyChatTemplate, Tokenize
from worker.server.responses import stream_response

if TYPE_CHECKING:
    from worker.engine.async_engine import AsyncEngine
    from worker.server.metrics import WorkerMetrics
    from worker.peer.plane import AskPeer, Fetched, PeerPlane
    from worker.engine.request import RequestOutput

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

    async def run(self, ae: AsyncEngine, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Serve one Generate call to its end (errors propagate to the server, which maps them)."""
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
        if inp.peer_hints and self.peer is not None:
            if isinstance(prompt, str):
                prompt = await ae.run(Tokenize(prompt))
            fetched = await self.peer.fetch(ae, prompt, inp.peer_hints, self._ask, inp.cache_salt)
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
                if first and self.peer is not None:
                    self.peer.observe_prefill(out.prompt_tokens - out.num_cached_tokens, time.perf_counter() - t0)
                first = False
                completion_tokens += out.completion_tokens if out.finished else 0
                await context.write(self.response(out, fetched, completion_tokens))
        finally:
            # Client cancelled or deadline passed (CancelledError here): closing the iterator
            # aborts the request and frees its blocks.
            await outputs.aclose()

    def response(self, out: RequestOutput, fetched: Fetched | None = None,
                 completion_tokens: int = 0) -> pb.GenerateResponse:
        resp = stream_response(out, self.worker_id)
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
