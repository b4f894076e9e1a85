"""Input hardening for the router's HTTP front: hostile input gets a
4xx with an OpenAI-style JSON body, never a 5xx or a hung connection.

Owns one aiohttp middleware (`guard_middleware`), placed right after authentication, that
- bounds the body by the model: at most `router/security/bounds.py` `body_limit` bytes
  (max_model_len x the tokenizer's bytes per token, JSON-escaped; the router's
  `max_message_bytes` before a worker is ready), a longer one is a 413 before it is read
  (by its Content-Length, or as it arrives when chunked);
- reads the body up front with a deadline (`http_read_timeout_s`): a body shorter than its
  Content-Length is a 408 instead of a handler waiting forever (aiohttp caches the bytes, so
  the handlers' own `request.read()` returns them);
- turns aiohttp's own errors (404 unknown path, 405 wrong method, 413 body too large, …) into
  OpenAI-style JSON;
- maps input the JSON decoder or protobuf cannot hold (nesting too deep for the decoder, lone
  surrogates in strings) to 400.
- refuses (403) a non-zero `priority` from a tenant the keys file does not flag (router/security/auth.py
  does the same on gRPC).
Handler-level validation (fields, types) stays in router/fronts/openai/app.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.routing.core import Router
from router.security.auth import PRIORITY_DENIED, TENANT_KEY
from router.security.bounds import body_limit

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("kvmesh.router.http")

_KIND = {401: "invalid_request_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> web.Response:
    kind = _KIND.get(status, "invalid_request_error" if status < 500 else "server_error")
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


async def max_body_bytes(router: Router) -> int:
    """The body bound now: by the model once a worker and the tokenizer are there, else the
    router's `max_message_bytes`."""
    info, tok, cap = router.model_info, router.tokenizer, router.cfg.max_message_bytes
    if info is None or tok is None:
        return cap
    return body_limit(info.max_model_len, await router.bounds.token_bytes(tok), cap)


def guard_middleware(read_timeout_s: float, router: Router) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware; `read_timeout_s` bounds reading one request body, `router`'s model its size."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.body_exists:
                limit = await max_body_bytes(router)
                length = request.content_length
                if length is not None and length > limit:
                    return openai_error(413, f"request body of {length} bytes exceeds {limit} bytes (the longest "
                                        "prompt this model's context can hold)", code="request_too_large",
                                        headers={"Connection": "close"})
                request = request.clone(client_max_size=limit)     # a chunked body stops at the limit
                try:
                    await asyncio.wait_for(request.read(), read_timeout_s)
                except TimeoutError:
                    return openai_error(408, f"request body not received within {read_timeout_s:g} s "
                                        "(shorter than its Content-Length?)", code="request_timeout",
                                        headers={"Connection": "close"})
                if _priority_refused(request, await request.read()):
                    return openai_error(403, PRIORITY_DENIED, "priority", "priority_not_allowed")
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _from_aiohttp(request, e)
        except RecursionError:
            return openai_error(400, "request body is nested too deeply", code="invalid_json")
        except UnicodeError as e:
            return openai_error(400, f"request holds text that is not valid Unicode (lone surrogate?): {e.reason}",
                                code="invalid_unicode")
    return guard


def _priority_refused(request: web.Request, raw: bytes) -> bool:
    """A body asking for a non-zero `priority` from a tenant the keys file does not flag."""
    key = request.get(TENANT_KEY)
    if key is None or key.priority or b"priority" not in raw:
        return False
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return False          # the handler answers 400 for the body itself
    return isinstance(body, dict) and body.get("priority") not in (None, 0)


def _from_aiohttp(request: web.Request, e: web.HTTPException) -> web.Response:
    headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
    if e.status == 405:
        allowed = e.headers.get("Allow", "")
        return openai_error(405, f"method {request.method} is not allowed on {request.path}"
                            + (f" (allowed: {allowed})" if allowed else ""), code="method_not_allowed",
                            headers=headers)
    if e.status == 404:
        return openai_error(404, f"no such endpoint: {request.method} {request.path}", code="not_found")
    if e.status == 413:
        return openai_error(413, e.text or "request body too large", code="request_too_large")
    return openai_error(e.status, e.reason or "bad request")
