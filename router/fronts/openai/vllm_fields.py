"""vLLM's extra request fields on the OpenAI HTTP endpoints: the table of accepted
names with their JSON types, their mapping onto the GenerateRequest contract, and the
rate-limited warning for fields nobody knows.

Owned by the HTTP front (router/fronts/openai/app.py calls `apply_vllm_fields` and `UnknownFieldLog`);
value ranges are checked once, by contracts.sampling.SamplingParams, so an out-of-range value
is the same 400 through HTTP and gRPC. Type errors are caught here, naming the field.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contracts.models import ModelLocateError, find_model_dir
from contracts.sampling import is_int, is_real
from proto.kvmesh.v1 import kvmesh_pb2 as pb

log = logging.getLogger("kvmesh.router.http")

Json = dict[str, Any]


class FieldError(ValueError):
    """A known field has a value of the wrong type; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# vLLM sampling extras carried on pb.SamplingParams, by JSON type.
_INT_FIELDS = ("top_k", "min_tokens", "truncate_prompt_tokens")
_REAL_FIELDS = ("min_p", "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")
# Request-level extras: priority and cache_salt on the GenerateRequest, add_special_tokens
# used by the front when it tokenizes, plus fields accepted with vLLM's defaults only.
VLLM_FIELDS = frozenset(_INT_FIELDS + _REAL_FIELDS + _BOOL_FIELDS + (
    "stop_token_ids", "priority", "cache_salt", "add_special_tokens"))


def vllm_field_types() -> dict[str, str]:
    """The JSON type ("int", "real", "bool") of each typed vLLM extra (router/fronts/openai/openapi.py);
    stop_token_ids and cache_salt have structured schemas there."""
    types = {name: "int" for name in _INT_FIELDS} | {name: "real" for name in _REAL_FIELDS}
    return types | {name: "bool" for name in _BOOL_FIELDS} | {"priority": "int", "add_special_tokens": "bool"}


def apply_vllm_fields(body: Json, msg: pb.GenerateRequest) -> None:
    """Copy the vLLM extras present in `body` onto `msg`; raises FieldError on a wrong type."""
    sp = msg.sampling
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None:
            _check(name, value, is_int, "an integer")
            _set(name, functools.partial(setattr, sp, name, value))
    for name in _REAL_FIELDS:
        value = body.get(name)
        if value is not None:
            _check(name, value, is_real, "a number")
            setattr(sp, name, value)
    for name in _BOOL_FIELDS:
        value = body.get(name)
        if value is not None:
            _check(name, value, lambda v: isinstance(v, bool), "a boolean")
            setattr(sp, name, value)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(is_int(t) and t >= 0 for t in ids):
            raise FieldError("stop_token_ids", f"must be a list of integers >= 0, got {ids!r}")
        _set("stop_token_ids", lambda: sp.stop_token_ids.extend(ids))
    priority = body.get("priority")
    if priority is not None:
        _check("priority", priority, is_int, "an integer")
        _set("priority", lambda: setattr(msg, "priority", priority))
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise FieldError("cache_salt", f"must be a non-empty string, got {salt!r}")
        msg.cache_salt = salt
    add = body.get("add_special_tokens")
    if add is not None:
        _check("add_special_tokens", add, lambda v: isinstance(v, bool), "a boolean")


def _check(name: str, value: object, ok: Callable[[object], bool], kind: str) -> None:
    if not ok(value):
        raise FieldError(name, f"must be {kind}, got {value!r}")


def _set(name: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except (ValueError, TypeError) as e:  # outside the int32 range of the contract
        raise FieldError(name, str(e)) from None


class UnknownFieldLog:
    """Warns about an unknown request field at most once per name per `period_s` (vLLM logs
    and ignores them; a log line per request would flood). One per HTTP front."""

    def __init__(self, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self._clock = clock
        self._last: dict[str, float] = {}

    def warn(self, names: list[str]) -> list[str]:
        """Log the names not warned about within the period; returns the names logged."""
        now = self._clock()
        due = [n for n in names if now - self._last.get(n, -self.period_s - 1.0) >= self.period_s]
        if len(self._last) > 4096:  # bounded: a client inventing names cannot grow it forever
            self._last.clear()
        for n in due:
            self._last[n] = now
        if due:
            log.warning("ignoring unknown request fields: %s", ", ".join(due))
        return due


def generation_default_temperature(model: str) -> float:
    """The `temperature` of the model's generation_config.json, else 1.0: vLLM's server takes
    its default sampling settings from there. `model` is an alias, GGUF or HF dir; a model
    that cannot be located here (the router then fails on its tokenizer) falls back to 1.0."""
    try:
        path = find_model_dir(model) / "generation_config.json"
    except ModelLocateError:
        return 1.0
    return read_default_temperature(path)


def read_default_temperature(path: Path) -> float:
    """`temperature` from one generation_config.json; 1.0 when absent; ValueError when the
    file is not JSON or the value is not a finite number >= 0."""
    if not path.is_file():
        return 1.0
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    value = config.get("temperature", 1.0) if isinstance(config, dict) else 1.0
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}: temperature must be a finite number >= 0, got {value!r}")
    return float(value)
