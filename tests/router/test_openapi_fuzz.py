"""`GET /openapi.json` and a schemathesis fuzz of the HTTP API it describes:
against one real worker (SmolLM2) and a router on loopback with `--max-tokens-limit 4` (so a
fuzzed request generates little), every generated request (schema-conforming and
schema-violating) gets a non-5xx answer within a per-request timeout, 4xx answers carry an
OpenAI-style error body, and a valid request is served afterwards.

The default run fuzzes a bounded example count per operation; `-m slow` runs a larger one.
"""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from router.config import RouterConfig
from router.fronts.openai.openapi import openapi_document
from router.server import RouterServer
from tests.router.test_router import start_cluster, stop_cluster


def _schema(coverage: bool) -> schemathesis.BaseSchema:
    """Schema-conforming and schema-violating requests; the coverage phase (hundreds of
    boundary cases per operation) only in the long run."""
    schema = schemathesis.openapi.from_dict(openapi_document("smollm2"))
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    schema.config.phases.coverage.enabled = coverage
    return schema


QUICK_SCHEMA, LONG_SCHEMA = _schema(coverage=False), _schema(coverage=True)
REQUEST_TIMEOUT_S = 30       # a fuzzed request that takes longer is a hang
QUICK = settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def base_url(smollm2_dir: Path) -> Iterator[str]:
    c = start_cluster(smollm2_dir, 1, http=False)
    cfg = RouterConfig(worker_addresses=tuple(c.worker_addresses), model=str(smollm2_dir), served_model_name="smollm2",
                       http_port=0, health_interval_s=0.2, max_tokens_limit=4)

    async def start() -> tuple[RouterServer, int | None]:
        router = RouterServer(cfg)
        _, h = await router.start()
        await router.wait_ready(10)
        return router, h
    router, port = c.lt.run(start())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            c.lt.run(router.stop(1))
        finally:
            stop_cluster(c)


def check(case: schemathesis.Case, base_url: str) -> None:
    response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:400])
    if response.status_code >= 400:
        body = json.loads(response.text)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


@pytest.mark.server
@QUICK_SCHEMA.parametrize()
@QUICK
def test_fuzz_no_5xx(case: schemathesis.Case, base_url: str) -> None:
    check(case, base_url)


@pytest.mark.slow
@LONG_SCHEMA.parametrize()
@LONG
def test_fuzz_no_5xx_long(case: schemathesis.Case, base_url: str) -> None:
    check(case, base_url)


@pytest.mark.server
def test_document_and_next_request_served(base_url: str) -> None:
    with urllib.request.urlopen(f"{base_url}/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                                 "/tokenize", "/detokenize", "/version", "/health",
                                                 "/metrics"} <= set(doc["paths"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"cache_salt", "min_p", "ignore_eos", "max_completion_tokens", "messages"} <= set(body["properties"])
    assert body["properties"]["min_p"] == {"type": "number"}
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(
        {"prompt": "The capital of France is", "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] >= 1


@pytest.mark.server
def test_found_by_fuzzing_extreme_repetition_penalty(base_url: str) -> None:
    """A repetition_penalty of 1.5e-42 overflowed the penalised logits to +inf: the sampler's
    softmax gave NaN and the worker answered INTERNAL (HTTP 500)."""
    request = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(
        {"prompt": "0 0 0 0", "repetition_penalty": 1.549763111661929e-42, "max_tokens": 3, "temperature": 1.0,
         "seed": 1}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
