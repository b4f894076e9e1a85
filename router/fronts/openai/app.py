"""OpenAI-compatible HTTP on the router's event loop: /v1/completions, /v1/chat/completions,
/v1/models, /health and /readyz (readiness), /live and /livez (liveness).

A request body becomes the same `GenerateRequest` → `GenerateInput` → `Router.prepare` →
`Router.generate` path (router/routing/core.py) as gRPC; only the JSON shapes differ. Every field OpenAI
documents for these endpoints is accepted, and vLLM's extras (router/fronts/openai/vllm_fields.py); logprobs,
n, best_of and echo are mapped and rendered by router/fronts/openai/choices.py; fields that would change
the output in ways kvmesh cannot honour (tools, logit_bias, …) are 400s; unknown fields are
ignored with a warning (at most once per name per minute), as vLLM does.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from contracts.logs import REQUEST_ID
from contracts.requests import BadRequest
from contracts.sampling import is_int
from contracts.tokenizer import ModelTokenizer, TokenizerError
from contracts.wire import to_generate_input
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.fronts.openai.body import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    STREAM_OPTIONS,
    UNSUPPORTED,
    HttpError,
    Json,
    bad_request,
    chat_message,
    http_error,
    parse_sampling,
    set_field,
)
from router.fronts.openai.choices import ChoiceSet, choice_options
from router.fronts.openai.client_errors import CLIENT_ERRORS, ClientErrors
from router.fronts.openai.guard import guard_middleware
from router.fronts.openai.utility_routes import add_utility_routes
from router.fronts.openai.vllm_fields import FieldError, UnknownFieldLog, apply_vllm_fields
from router.routing.core import Router
from router.routing.errors import NoWorkerAvailable, TokenizerNotLoaded, UpstreamError
from router.security.auth import ANONYMOUS, TENANT_KEY, authenticator_for, release_slot


class HttpFrontend:
    """The aiohttp app over one routing core; started and stopped by its RouterServer
    (router/server.py). HTTP statuses are chosen in router/fronts/openai/body.py `http_error`."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.created = int(time.time())
        self._active: set[asyncio.Task[Any]] = set()
        self._unknown_fields = UnknownFieldLog()
        middlewares = [authenticator_for(router).http_middleware(),
                       guard_middleware(router.cfg.http_read_timeout_s, router), self._track, _errors]
        app = web.Application(client_max_size=router.cfg.max_message_bytes, middlewares=middlewares)
        # aiohttp's server logger: client-caused framing errors and disconnects are counted and
        # logged as one rate-limited WARNING, not an ERROR traceback each
        self.client_errors = app[CLIENT_ERRORS] = ClientErrors()
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/readyz", self.health), web.get("/live", self.live),
                        web.get("/livez", self.live)])
        add_utility_routes(app, router)  # /tokenize, /detokenize, /version
        # A client that disconnects cancels its handler, which cancels the upstream call.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=self.client_errors,
                                     keepalive_timeout=router.cfg.http_idle_timeout_s)

    @property
    def app(self) -> web.Application:
        """The aiohttp app, for modules that add their own routes (router/observe/metrics.py) before `start()`."""
        return self._runner.app

    async def start(self, host: str, port: int) -> int:
        await self._runner.setup()
        tls = self.router.cfg.tls
        ssl_context = tls.http_ssl_context() if tls.serves_tls else None
        await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()
        return int(self._runner.addresses[0][1])

    async def drain(self, grace: float | None) -> None:
        """Let requests in flight finish for `grace` s (None: wait) and cancel the rest; the
        port stays open (readiness answers 503 meanwhile)."""
        if self._active:
            _, pending = await asyncio.wait(set(self._active), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def stop(self, grace: float | None) -> None:
        """`drain`, then close the port."""
        await self.drain(grace)
        await self._runner.cleanup()

    @web.middleware
    async def _track(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        try:
            return await handler(request)
        finally:
            self._active.discard(task)

    def _tokenizer(self) -> ModelTokenizer:
        tok = self.router.tokenizer
        if tok is None:
            if self.router.model_info is None:
                raise NoWorkerAvailable("no worker is ready")
            raise TokenizerNotLoaded()
        return tok

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids, tokenized on the core's bounded pool once its length is checked against
        the context (router/security/bounds.py); BadRequest for a prompt too long by its characters."""
        tok, info = self._tokenizer(), self.router.model_info
        if info is None:
            raise NoWorkerAvailable("no worker is ready")
        max_chars = info.max_model_len * await self.router.bounds.token_bytes(tok)
        if len(text) > max_chars:
            raise BadRequest(f"prompt: the prompt has {len(text)} characters; this model takes at most "
                             f"{info.max_model_len - 1} tokens, which is at most {max_chars} characters")
        return await self.router.bounds.run(tok.encode, text, add_special_tokens)

    @property
    def default_temperature(self) -> float:
        """vLLM's default: the model's generation_config.json (set with the tokenizer)."""
        return self.router.default_temperature

    @property
    def model_name(self) -> str:
        return self.router.cfg.served_model_name or self.router.cfg.model

    # -- endpoints ------------------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        """Liveness (/live, /livez): 200 while the event loop runs (answering at all means it
        does), whether or not a worker is ready. `/health` and `/readyz` are readiness: 503 until
        a worker is ready and the tokenizer is loaded, and while draining."""
        return web.json_response({"status": "live"})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.router.serving
        return web.json_response({"status": "serving" if ok else "not serving"}, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        info = self.router.model_info
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvmesh",
             "root": self.router.cfg.model, "parent": None,
             "max_model_len": info.max_model_len if info is not None else None}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        msg = pb.GenerateRequest(request_id=_request_id(request, "cmpl"))  # first: its id on every log line
        body = await self._body(request, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and body.get("add_special_tokens") is not None:
            add = body["add_special_tokens"]  # vLLM: default True for completions
            if not isinstance(add, bool):
                raise HttpError(400, f"add_special_tokens: must be a boolean, got {add!r}", "add_special_tokens")
            ids = await self._encode(prompt, add)
            set_field(lambda: msg.token_ids.ids.extend(ids), "prompt")
        elif isinstance(prompt, str):
            msg.text = prompt
        elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            set_field(lambda: msg.token_ids.ids.extend(prompt), "prompt")
        elif isinstance(prompt, list) and not prompt:
            raise HttpError(400, "prompt: the prompt is empty", "prompt")
        else:
            raise HttpError(400, "prompt: must be a string or a list of token ids (one prompt)", "prompt")
        return await self._serve(request, body, msg, chat=False, default_max_tokens=16)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        msg = pb.GenerateRequest(request_id=_request_id(request, "chatcmpl"))  # first: its id on every log line
        body = await self._body(request, CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages: must be a non-empty list", "messages")
        chat = [chat_message(m, i) for i, m in enumerate(messages)]
        if body.get("add_special_tokens") is True:  # vLLM: default False for chat
            tok = self._tokenizer()
            try:
                text = tok.render_chat([{"role": m.role, "content": m.content} for m in chat])
            except TokenizerError as e:
                raise HttpError(400, f"messages: {e}", "messages") from None
            msg.token_ids.ids.extend(await self._encode(text, True))
        else:
            msg.chat.messages.extend(chat)
        if body.get("max_completion_tokens") is not None:
            body["max_tokens"] = body["max_completion_tokens"]
        info = self.router.model_info
        return await self._serve(request, body, msg, chat=True,
                                 default_max_tokens=info.max_model_len if info is not None else 16)

    # -- the shared path ------------------------------------------------------------------
    async def _body(self, request: web.Request, allowed: set[str]) -> Json:
        length = request.content_length
        if length is not None and length > self.router.cfg.max_message_bytes:
            raise HttpError(413, f"request body of {length} bytes exceeds {self.router.cfg.max_message_bytes}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise HttpError(413, f"request body exceeds {self.router.cfg.max_message_bytes} bytes") from None
        try:
            body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except UnicodeDecodeError as e:
            raise HttpError(400, f"request body is not valid UTF-8: {e}") from None
        except ValueError as e:
            raise HttpError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "request body must be a JSON object")
        unknown = sorted(set(body) - allowed)
        if unknown:
            self._unknown_fields.warn([name[:64] for name in unknown])
        for name, ok in UNSUPPORTED.items():
            if name in body and not ok(body[name]):
                raise HttpError(400, f"{name}={body[name]!r} is not supported by kvmesh", name, "unsupported")
        model = body.get("model")
        info = self.router.model_info
        if model is not None and model not in (self.model_name, self.router.cfg.model, info.model if info else None):
            raise HttpError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        if not isinstance(body.get("stream", False), bool) and body.get("stream") is not None:
            raise HttpError(400, "stream: must be a boolean", "stream")
        return body

    async def _serve(self, request: web.Request, body: Json, msg: pb.GenerateRequest, *, chat: bool,
                     default_max_tokens: int) -> web.StreamResponse:
        parse_sampling(body, msg.sampling)
        if body.get("temperature") is None:
            msg.sampling.temperature = self.default_temperature
        try:
            apply_vllm_fields(body, msg)
            opts = choice_options(body, msg.sampling, chat)
        except FieldError as e:
            raise HttpError(400, str(e), e.field) from None
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict) or set(stream_options) - STREAM_OPTIONS:
            raise HttpError(400, f"stream_options: accepted keys are {', '.join(sorted(STREAM_OPTIONS))}",
                            "stream_options")
        try:
            prepared = await self.router.prepare(to_generate_input(msg, default_max_tokens=default_max_tokens),
                                                 request.get(TENANT_KEY, ANONYMOUS))
        except BadRequest as e:
            raise bad_request(str(e)) from None
        head = {"id": msg.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model") or self.model_name}
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
        choices = ChoiceSet(opts, self._tokenizer(), prepared.request.token_ids.ids,
                            prompt if isinstance(prompt, str) and body.get("truncate_prompt_tokens") is None else None)
        async with contextlib.aclosing(self.router.generate(prepared, None)) as upstream:
            first = await _first(upstream)
            if body.get("stream"):
                usage = _UsageMode(bool(stream_options.get("include_usage")),
                                   bool(stream_options.get("continuous_usage_stats")),
                                   len(prepared.request.token_ids.ids))
                return await self._stream(request, head, choices, first, upstream, usage)
            choices.add(first)
            last = first
            async for r in upstream:
                choices.add(r)
                last = r
        return web.json_response(head | {"choices": choices.render(), "usage": _usage(last),
                                         "kvmesh": {"worker_id": last.worker_id}})

    async def _stream(self, request: web.Request, head: Json, choices: ChoiceSet, first: pb.GenerateResponse,
                      upstream: AsyncIterator[pb.GenerateResponse], usage: _UsageMode) -> web.StreamResponse:
        chat = choices.opts.chat
        head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}
        include_usage = usage.final
        extra: Json = {"usage": None} if include_usage else {}
        completion_tokens = 0
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(items: list[Json], **more: Any) -> None:
            data = head | {"choices": items} | extra | more
            if usage.continuous and "usage" not in more:  # vLLM: usage in every chunk
                data["usage"] = _usage_counts(usage.prompt_tokens, completion_tokens)
            await resp.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

        opening = choices.opening()
        if opening:
            await send(opening)
        last: pb.GenerateResponse | None = None
        try:
            r: pb.GenerateResponse | None = first
            while r is not None:
                last = r
                if r.finished:
                    release_slot(request)   # over: the tenant's next request may start as this one's last chunk goes
                completion_tokens += len(r.token_ids)
                deltas = choices.delta(r)   # one chunk per choice: n choices stream interleaved
                for i, choice in enumerate(deltas):
                    last_one = r.finished and i == len(deltas) - 1
                    await send([choice], **({"kvmesh": {"worker_id": r.worker_id}} if last_one else {}))
                r = await anext(upstream, None)  # type: ignore[arg-type]
        except (BadRequest, NoWorkerAvailable, UpstreamError) as e:
            # No silent truncation: headers are sent, so the error is the stream's last event.
            await resp.write(f"data: {json.dumps(http_error(e).body())}\n\n".encode())
        else:
            assert last is not None and last.finished, "Router.generate ends with a finished response or raises"
            if include_usage:
                await send([], **{"kvmesh": {"worker_id": last.worker_id}, "usage": _usage(last)})
        release_slot(request)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    try:
        return await handler(request)
    except (HttpError, BadRequest, NoWorkerAvailable, UpstreamError) as e:
        err = http_error(e)
        return web.json_response(err.body(), status=err.status)


async def _first(upstream: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse:
    """The first response, before any header is sent, so early errors get a real status."""
    first = await anext(upstream, None)  # type: ignore[arg-type]
    if first is None:
        raise UpstreamError(grpc.StatusCode.UNAVAILABLE, "the worker closed the stream without a response")
    return first


@dataclass(frozen=True, slots=True)
class _UsageMode:
    """stream_options: usage in a final chunk (`final`), and in every chunk (`continuous`,
    vLLM's continuous_usage_stats, honoured with include_usage as in vLLM)."""

    final: bool
    continuous_requested: bool
    prompt_tokens: int

    @property
    def continuous(self) -> bool:
        return self.final and self.continuous_requested


def _usage_counts(prompt_tokens: int, completion_tokens: int) -> Json:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage(last: pb.GenerateResponse) -> Json:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens}}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")    # printable ASCII, no spaces


def _request_id(request: web.Request, prefix: str) -> str:
    """The client's `x-request-id` (the id in the router's and the worker's log lines and in the
    response), else a fresh `<prefix>-<hex>`; a malformed header is a 400."""
    given = request.headers.get("x-request-id")
    if given is None:
        given = f"{prefix}-{uuid.uuid4().hex}"
    elif not _REQUEST_ID.fullmatch(given):
        raise HttpError(400, "x-request-id: must be 1-128 printable ASCII characters without spaces", None)
    REQUEST_ID.set(given)    # on every log line of this request (contracts/logs.py)
    return given
