"""vLLM's utility endpoints on the router's HTTP app: `POST /tokenize`,
`POST /detokenize`, `GET /version`, `POST /reset_prefix_cache`, in vLLM's request/response shapes.

`/reset_prefix_cache` fans out to every live worker (Worker.ResetPrefixCache) and drops their
device blocks from the router's block index; with API keys configured only keys flagged
`admin` in the keys file may call it (403 otherwise).

Registered by HttpFrontend (router/fronts/openai/app.py) with `add_utility_routes`; tokenization runs on
the core's bounded pool (router/security/bounds.py: a prompt longer in characters than the context
can hold is refused first) with the router's own ModelTokenizer, the one the generate path uses,
so the ids here are the ids a generation sees. Errors are BadRequest / NoWorkerAvailable, mapped to 400 / 503
by the HTTP front's error middleware.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
from typing import Any

import grpc
from aiohttp import web

from contracts.requests import BadRequest
from contracts.sampling import is_int
from contracts.tokenizer import ModelTokenizer, TokenizerError
from kvstore.events import Tier
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.routing.core import Router
from router.routing.errors import NoWorkerAvailable, TokenizerNotLoaded
from router.security.auth import ANONYMOUS, TENANT_KEY

log = logging.getLogger("kvmesh.router.http")

Json = dict[str, Any]


def kvmesh_version() -> str:
    try:
        return importlib.metadata.version("kvmesh")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


class UtilityRoutes:
    """The handlers; holds only the routing core (for its tokenizer and model info)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def _ready(self) -> tuple[ModelTokenizer, int]:
        tok, info = self.router.tokenizer, self.router.model_info
        if info is None:
            raise NoWorkerAvailable("no worker is ready")
        if tok is None:
            raise TokenizerNotLoaded()
        return tok, info.max_model_len

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM: {"prompt": str, "add_special_tokens": true} or {"messages": [...],
        "add_generation_prompt": true, "add_special_tokens": false} ->
        {"count", "max_model_len", "tokens", "token_strs"}."""
        body = await _json(request)
        tok, max_model_len = self._ready()
        add = _bool(body, "add_special_tokens", default="messages" not in body)
        if "messages" in body:
            messages = body["messages"]
            ok = isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)
            if not ok:
                raise BadRequest("messages: must be a non-empty list of {role, content} strings")
            gen = _bool(body, "add_generation_prompt", default=True)
            try:
                text = tok.render_chat([{"role": m["role"], "content": m["content"]} for m in messages], gen)
            except TokenizerError as e:
                raise BadRequest(f"messages: {e}") from None
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise BadRequest("prompt: set a string prompt or messages")
        max_chars = max_model_len * await self.router.bounds.token_bytes(tok)
        if len(text) > max_chars:     # refused before tokenizing (router/security/bounds.py)
            raise BadRequest(f"prompt: {len(text)} characters; this model's context holds at most {max_chars}")
        ids = await self.router.bounds.run(tok.encode, text, add)
        strs = None
        if _bool(body, "return_token_strs", default=False):
            strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return web.json_response({"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM: {"tokens": [int]} -> {"prompt": str}."""
        body = await _json(request)
        tok, _ = self._ready()
        ids = body.get("tokens")
        vocab = self.router.model_info.vocab_size if self.router.model_info else 0
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise BadRequest(f"tokens: must be a list of token ids in [0, {vocab})")
        text = await asyncio.to_thread(tok.decode, ids, False)
        return web.json_response({"prompt": text})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": kvmesh_version()})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Every live worker drops its prefix cache -> {"reset": {worker_id: bool}} (false: that
        worker had requests running, or did not answer)."""
        key = request.get(TENANT_KEY, ANONYMOUS)
        if not key.admin:
            body = {"error": {"message": "reset_prefix_cache: this API key is not flagged 'admin' in the keys file",
                              "type": "permission_error", "param": None, "code": "forbidden"}}
            return web.json_response(body, status=403)
        workers = [w for w in self.router.registry.live() if w.info is not None]
        if not workers:
            raise NoWorkerAvailable("no worker is ready")
        done = await asyncio.gather(*(self._reset_one(w) for w in workers))
        return web.json_response({"reset": dict(done)})

    async def _reset_one(self, worker: Any) -> tuple[str, bool]:
        worker_id = worker.info.worker_id
        try:
            reply = await worker.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            log.warning("reset_prefix_cache: worker %s: %s %s", worker_id, e.code().name, e.details())
            return worker_id, False
        index = self.router.registry.index
        if reply.reset:
            index.discard(worker_id, list(index.holdings(worker_id)), Tier.DEVICE)
        return worker_id, bool(reply.reset)


def add_utility_routes(app: web.Application, router: Router) -> None:
    routes = UtilityRoutes(router)
    app.add_routes([web.post("/tokenize", routes.tokenize), web.post("/detokenize", routes.detokenize),
                    web.get("/version", routes.version), web.post("/reset_prefix_cache", routes.reset_prefix_cache)])


async def _json(request: web.Request) -> Json:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body: not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    return body


def _bool(body: Json, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name}: must be a boolean, got {value!r}")
    return value
