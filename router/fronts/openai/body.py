"""OpenAI request bodies on the router's HTTP front (router/fronts/openai/app.py): the field tables (also
read by router/fronts/openai/openapi.py, which generates the OpenAPI document from them), the parsing of
sampling numbers and chat messages, and the one OpenAI-style error shape with its status mapping
(`http_error`: the only place HTTP statuses are chosen)."""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from contracts.requests import BadRequest
from contracts.sampling import is_int, is_real
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.fronts.openai.vllm_fields import VLLM_FIELDS
from router.routing.errors import NoWorkerAvailable, TokenizerNotLoaded, UpstreamError

Json = dict[str, Any]

_SAMPLING_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
_COMMON = {"model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
           "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user"} | VLLM_FIELDS
_COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
_CHAT_FIELDS = _COMMON | {
    "messages", "audio", "function_call", "functions", "max_completion_tokens", "metadata", "modalities",
    "parallel_tool_calls", "prediction", "prompt_cache_key", "reasoning_effort", "response_format",
    "safety_identifier", "service_tier", "store", "tool_choice", "tools", "top_logprobs", "verbosity",
    "web_search_options"}
# Documented fields kvmesh cannot honour: accepted only with a value that changes nothing.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: not v,
    "logit_bias": lambda v: not v, "tools": lambda v: not v, "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"), "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"}, "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]), "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
# The field tables, public for router/fronts/openai/openapi.py (the OpenAPI document is generated from them).
COMPLETION_FIELDS, CHAT_FIELDS, UNSUPPORTED = _COMPLETION_FIELDS, _CHAT_FIELDS, _UNSUPPORTED
SAMPLING_NUMBERS, STREAM_OPTIONS = _SAMPLING_NUMBERS, _STREAM_OPTIONS
_STATUS = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
           "NOT_FOUND": 404}


class HttpError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> Json:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def http_error(e: Exception) -> HttpError:
    if isinstance(e, HttpError):
        return e
    if isinstance(e, BadRequest):
        return bad_request(str(e))
    if isinstance(e, NoWorkerAvailable):
        code = "tokenizer_not_loaded" if isinstance(e, TokenizerNotLoaded) else "no_worker"
        return HttpError(503, str(e), code=code, kind="service_unavailable")
    assert isinstance(e, UpstreamError)
    status = _STATUS.get(e.code.name, 500)
    return HttpError(status, e.details, code=e.code.name.lower(),
                     kind="invalid_request_error" if status < 500 else "server_error")


def bad_request(message: str) -> HttpError:
    m = re.match(r"(?:sampling\.)?([a-z_]+)", message)
    param = {"text": "prompt", "token_ids": "prompt", "input": "prompt", "chat": "messages"}.get(
        m.group(1), m.group(1)) if m else None
    return HttpError(400, message, param)


def parse_sampling(body: Json, sp: pb.SamplingParams) -> None:
    for name in _SAMPLING_NUMBERS:
        value = body.get(name)
        if value is not None:
            if not is_real(value):
                raise HttpError(400, f"{name}: must be a number, got {value!r}", name)
            setattr(sp, name, value)
    for name in ("max_tokens", "seed"):
        value = body.get(name)
        if value is not None:
            if not is_int(value):
                raise HttpError(400, f"{name}: must be an integer, got {value!r}", name)
            set_field(functools.partial(setattr, sp, name, value), name)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise HttpError(400, "stop: must be a non-empty string or a list of them", "stop")
        sp.stop.extend(stops)


def chat_message(m: object, i: int) -> pb.ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise HttpError(400, f"{param}: must be an object with a role", param)
    extra = {k for k, v in m.items() if k not in ("role", "content", "name") and v not in (None, [])}
    if extra:
        raise HttpError(400, f"{param}: unsupported fields {sorted(extra)}", param)
    role = "system" if m["role"] == "developer" else m["role"]
    if role not in ("system", "user", "assistant"):
        raise HttpError(400, f"{param}.role: {m['role']!r}; accepted: system, developer, user, assistant", param)
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise HttpError(400, f"{param}.content: only text parts are supported", param)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise HttpError(400, f"{param}.content: must be a string or a list of text parts", param)
    return pb.ChatMessage(role=role, content=content)


def set_field(fn: Callable[[], object], param: str) -> None:
    try:
        fn()
    except (ValueError, TypeError) as e:  # out of the int32 / int64 range of the contract
        raise HttpError(400, f"{param}: {e}", param) from None
