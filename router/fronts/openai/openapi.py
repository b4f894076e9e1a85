"""`GET /openapi.json`: an OpenAPI 3.0 document of the router's HTTP API.

The request bodies of /v1/completions and /v1/chat/completions are generated from the field
tables the HTTP front validates with (router/fronts/openai/app.py: the accepted names and the documented
fields kvmesh cannot honour; router/fronts/openai/vllm_fields.py: vLLM's extras by JSON type), so a field
added there appears here without a second list. Only structured fields (prompt, messages,
stop, stream_options, …) have hand-written schemas. The utility and observability endpoints
are described by hand. Torch-free.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from contracts.sampling import MAX_N
from router.fronts.openai import body as http
from router.fronts.openai.utility_routes import kvmesh_version
from router.fronts.openai.vllm_fields import vllm_field_types

Json = dict[str, Any]

_JSON_TYPES = {"int": {"type": "integer"}, "real": {"type": "number"}, "bool": {"type": "boolean"}}
_STRING = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [_STRING, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STRING}}}]},
    "name": _STRING}}
# Fields whose shape is more than a JSON type; every other name gets its type from the tables.
_STRUCTURED: dict[str, Json] = {
    "user": _STRING, "cache_salt": {"type": "string", "minLength": 1, "maxLength": 1024},
    "prompt": {"oneOf": [_STRING, {**_TOKEN_IDS, "minItems": 1},
                         {"type": "array", "items": _STRING, "minItems": 1, "maxItems": 1}]},
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}}]},
    "stop_token_ids": _TOKEN_IDS, "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1}, "max_completion_tokens": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N}, "best_of": {"type": "integer", "minimum": 1,
                                                                          "maximum": MAX_N},
    "echo": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0},
    "logprobs": {"description": "completions: the number of top alternatives; chat: a boolean",
                 "oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0}], "nullable": True},
}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": _STRING, "type": _STRING, "param": {"type": "string", "nullable": True},
                   "code": {"type": "string", "nullable": True}}}}}
_ERROR_STATUSES = {"400": "bad input (the message names the field)", "401": "missing or wrong API key",
                   "403": "priority not allowed for this tenant", "404": "unknown model",
                   "408": "the body did not arrive in time", "413": "body too large",
                   "429": "too many requests in flight for this tenant"}


def _field_schema(name: str, model: str) -> Json:
    if name == "model":
        return {"type": "string", "enum": [model]}
    if name in _STRUCTURED:
        return _STRUCTURED[name]
    vllm = vllm_field_types().get(name)
    if vllm is not None:
        return _JSON_TYPES[vllm]
    if name in http.SAMPLING_NUMBERS:
        return {"type": "number"}
    if name == "stream_options":
        return {"type": "object", "nullable": True,
                "properties": {k: {"type": "boolean"} for k in sorted(http.STREAM_OPTIONS)}}
    if name in http.UNSUPPORTED:
        return {"description": "accepted only with a value that changes nothing (else 400, code unsupported)"}
    return {"description": "accepted (OpenAI field) and ignored"}


def _request_body(fields: set[str], required: str, model: str) -> Json:
    properties = {name: _field_schema(name, model) for name in sorted(fields)}
    return {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": [required], "properties": properties}}}}


def _responses(ok: str, schema: Json | None = None, errors: bool = True) -> Json:
    content = {"application/json": {"schema": schema or {"type": "object"}}}
    out: Json = {"200": {"description": ok, "content": content}}
    if errors:
        for status, why in _ERROR_STATUSES.items():
            out[status] = {"description": why, "content": {"application/json": {"schema": _ERROR}}}
    out["503"] = {"description": "no worker ready (or draining)"}
    return out


def _post(summary: str, body: Json, ok: str) -> Json:
    return {"post": {"summary": summary, "requestBody": body, "responses": _responses(ok)}}


def _get(summary: str, ok: str, content_type: str = "application/json") -> Json:
    return {"get": {"summary": summary, "responses": {"200": {"description": ok, "content": {
        content_type: {"schema": {"type": "object"} if content_type == "application/json" else _STRING}}},
        "503": {"description": "not ready"}}}}


def openapi_document(model: str) -> Json:
    """The OpenAPI 3.0 document of the HTTP API of a router serving `model` (its HTTP id)."""
    tokenize = {"required": True, "content": {"application/json": {"schema": {"type": "object", "properties": {
        "prompt": _STRING, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "add_special_tokens": {"type": "boolean"}, "add_generation_prompt": {"type": "boolean"},
        "return_token_strs": {"type": "boolean"}}}}}}
    detokenize = {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["tokens"], "properties": {"tokens": _TOKEN_IDS}}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvmesh router", "version": kvmesh_version(),
                 "description": "OpenAI-compatible HTTP API of the kvmesh router (see README: HTTP fields)"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
        "paths": {
            "/v1/completions": _post("text completion", _request_body(http.COMPLETION_FIELDS, "prompt", model),
                                     "a text_completion (or an SSE stream with stream=true)"),
            "/v1/chat/completions": _post("chat completion", _request_body(http.CHAT_FIELDS, "messages", model),
                                          "a chat.completion (or an SSE stream with stream=true)"),
            "/tokenize": _post("vLLM: token ids of a prompt or chat", tokenize, "count, max_model_len, tokens"),
            "/detokenize": _post("vLLM: text of token ids", detokenize, "prompt"),
            "/v1/models": _get("the served model", "a list with one model"),
            "/version": _get("kvmesh version", "version"),
            "/health": _get("readiness: 200 while a worker is ready and the tokenizer loaded", "serving"),
            "/readyz": _get("readiness (= /health): 200 while a worker is ready and the tokenizer loaded",
                            "serving"),
            "/live": _get("liveness: 200 while the router's event loop runs", "live"),
            "/livez": _get("liveness (= /live)", "live"),
            "/v1/cluster": _get("workers, loads and routing counters", "kvmesh.cluster"),
            "/metrics": _get("Prometheus metrics", "text exposition format", "text/plain"),
            "/openapi.json": _get("this document", "OpenAPI 3.0"),
        },
    }


def add_openapi_route(app: web.Application, model: str) -> None:
    """Serve the document at `GET /openapi.json` (behind the API keys, like the rest)."""
    document = openapi_document(model)

    async def handle(request: web.Request) -> web.Response:
        return web.json_response(document)
    app.add_routes([web.get("/openapi.json", handle)])
