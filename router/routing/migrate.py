"""Request migration: when the worker under a stream dies or becomes
unreachable, the router re-submits the request to another ready worker and the client's
stream continues without an error.

What is re-submitted: the prompt token ids followed by every token the client has already
received, with `resume_tokens` = how many of them are output (proto GenerateRequest field 45),
the same sampling params and seed. The new worker treats the resumed tokens as its own output
(worker/engine/engine.py `Engine._resume`): `max_tokens` / `min_tokens` count them, penalties see
them, the text it streams starts exactly where the client's text stopped (the detokenizer
re-decodes the whole output), a stop string spanning the seam still stops, and a seeded
generator is advanced by one draw per resumed token, so seeded sampling continues as an
uninterrupted run would (given the same logits on the new worker). Usage: `prompt_tokens`
is the original prompt, `completion_tokens` all generated tokens.

Which failures move a request (`is_migratable`): gRPC UNAVAILABLE (connection refused or
reset: the worker died), a stream that ends without a finished response, and `WorkerLost`
(the registry's probes found the worker unreachable while the stream was open: a partition
or a hung process, where the call itself would hang). Any other status (a bad request, the
client's deadline) goes to the client. `RouterConfig.migration_limit` bounds the
re-submissions per request (0: never migrate; a failure before anything streamed is still
retried once on another worker). torch-free.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc

from kvstore.keys import block_hashes, cache_salt_root
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.types import RouteRequest

log = logging.getLogger("kvmesh.router")
MAX_WAIT_FOR_WORKER_S = 30.0   # mid-stream, with no worker ready: wait this long for one


class WorkerLost(Exception):
    """The worker under an open stream was found unreachable by the registry's probes."""


@dataclass
class Progress:
    """One request's journey over workers: the tokens the client has received and how often
    it was re-submitted. Owned by `Router.generate` for the request's lifetime."""

    prompt: pb.GenerateRequest
    limit: int
    started: float                       # time.perf_counter() when the router got the request
    ttft_s: float | None = None          # first response, seen by the client
    generated: list[int] = field(default_factory=list)
    resubmits: int = 0
    migrations: int = 0          # re-submissions with tokens already streamed

    def note(self, response: pb.GenerateResponse) -> None:
        self.generated.extend(response.token_ids)

    def may_resubmit(self) -> bool:
        """Another attempt is allowed: within `limit` (a not-yet-streaming request: at least once).
        Several sequences per request (n / best_of > 1) never move mid-stream: their streamed
        tokens belong to different sequences."""
        if not self.generated:
            return self.resubmits < max(self.limit, 1)
        s = self.prompt.sampling
        return self.resubmits < self.limit and s.n <= 1 and s.best_of <= 1

    def resubmit(self, block_size: int, salt: bytes) -> tuple[pb.GenerateRequest, RouteRequest]:
        """The request to send next and what routing sees (prompt + generated tokens)."""
        self.resubmits += 1
        request = pb.GenerateRequest()
        request.CopyFrom(self.prompt)
        if self.generated:
            self.migrations += 1
            request.token_ids.ids.extend(self.generated)
            request.resume_tokens = len(self.generated)
            request.sampling.ClearField("prompt_logprobs")   # the client has them already
        ids = tuple(request.token_ids.ids)
        root = cache_salt_root(request.cache_salt)   # the tenant's salted chain, as prepare hashed it
        return request, RouteRequest(ids, tuple(block_hashes(ids, block_size, salt, root)))


def is_migratable(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.UNAVAILABLE


async def read_until_lost(call: grpc.aio.UnaryStreamCall,
                          lost: asyncio.Event) -> AsyncGenerator[pb.GenerateResponse, None]:
    """The call's responses until it ends; raises WorkerLost as soon as `lost` is set (the
    caller cancels the call), and the call's own AioRpcError."""
    lost_wait = asyncio.ensure_future(lost.wait())
    read: asyncio.Future[object] | None = None
    try:
        while True:
            read = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({read, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                raise WorkerLost("the worker stopped answering its health probes")
            response = read.result()
            read = None
            if response is grpc.aio.EOF:
                return
            assert isinstance(response, pb.GenerateResponse)
            yield response
    finally:
        for task in (read, lost_wait):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await task


def log_migration(request_id: str, worker_id: str, why: str, progress: Progress) -> None:
    log.warning("kvmesh router: request %s migrating off worker %s after %d tokens (%s); "
                "migration %d of %d", request_id, worker_id, len(progress.generated), why,
                progress.migrations + 1, progress.limit)
