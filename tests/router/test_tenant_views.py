"""Views of the cluster scoped to the caller, met the way two tenants and an operator meet them:
raw HTTP with each key against every route of the router's HTTP app, grpcio for the gRPC
methods, and the dashboard in headless Chromium.

One real worker (SmolLM2) behind two routers with one keys file: tenants alpha and beta
(ordinary keys) and ops (`admin`). The second router runs with `metrics_tenant_names`. Alpha
sends a confidential system prompt; beta must not be able to read it, its hash, or alpha's
request counts anywhere; the admin key sees everything.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from contracts.requests import ChatMessage, GenerateInput
from contracts.sampling import SamplingParams
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.security.auth import parse_keys_file
from router.security.tenancy import TenantSalts
from router.server import RouterServer
from tests.router.test_dashboard import browser, page_values, wait_for  # noqa: F401 - the browser fixture
from tests.router.test_router import NUM_BLOCKS
from tests.support.loop_thread import LoopThread

KEYS = {"alpha": "sk-alpha-0001", "beta": "sk-beta-0002", "ops": "sk-ops-0003"}
SECRET = "Zephyr"
ALPHA_SYSTEM = (f"ALPHA CONFIDENTIAL #31: Project {SECRET} merger with Globex at 41 dollars per share, board "
                "vote on Friday. Never disclose any of this to anyone outside the deal team. ") * 2
BETA_SYSTEM = ("You are beta's travel assistant. Answer questions about trains in Europe briefly, "
               "in one sentence, and recommend night trains where they exist. ") * 2
# Every route of the router's HTTP app, by what it may return about the cluster. A route added
# later fails `test_every_route_is_classified` until it is put here and checked.
SCOPED = {"/v1/cluster", "/metrics"}                  # cluster state, scoped to the caller
STATELESS = {"/v1/models", "/version", "/openapi.json", "/tokenize", "/detokenize", "/dashboard",
             "/health", "/readyz", "/live", "/livez"}  # no tenant's state
GENERATING = {"/v1/completions", "/v1/chat/completions"}   # the caller's own request
ADMIN_ONLY = {"/reset_prefix_cache"}


@dataclass
class Views:
    lt: LoopThread
    worker: Any                 # WorkerServer
    router: RouterServer        # opaque tenant ids on an open /metrics
    http: int
    grpc: int
    named_http: int             # the router with metrics_tenant_names


@pytest.fixture(scope="module")
def views(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Views]:
    from worker.engine.engine import Engine, EngineConfig
    from worker.server.service import WorkerServer, WorkerServerConfig
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(f"{KEYS['alpha']} alpha\n{KEYS['beta']} beta\n{KEYS['ops']} ops admin\n")
    keys = parse_keys_file(keys_file)
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_blocks=NUM_BLOCKS))
    lt = LoopThread()
    worker = WorkerServer(engine.cfg, WorkerServerConfig(worker_id="worker-0"), engine=engine)
    lt.run(worker.start())
    lt.run(worker.wait_ready(60))

    async def start(names: bool) -> tuple[RouterServer, int, int]:
        router = RouterServer(RouterConfig(worker_addresses=(worker.address,), model=str(smollm2_dir),
                                           served_model_name="smollm2", http_port=0, health_interval_s=0.2,
                                           api_keys=keys, metrics_tenant_names=names))
        g, h = await router.start()
        await router.wait_ready(10)
        assert h is not None
        return router, g, h
    router, g, h = lt.run(start(False))
    named, _, named_h = lt.run(start(True))
    v = Views(lt, worker, router, h, g, named_h)
    try:
        for port in (h, named_h):
            for question in ("Who votes?", "When is the vote?"):
                chat(port, "alpha", ALPHA_SYSTEM, question)
            chat(port, "beta", BETA_SYSTEM, "Is there a night train from Vienna to Rome?")
        yield v
    finally:
        try:
            for r in (router, named):
                lt.run(r.stop(1))
            lt.run(worker.stop(1))
        finally:
            lt.close()


def request(port: int, path: str, tenant: str | None = None, body: Any = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if tenant is not None:
        headers["Authorization"] = f"Bearer {KEYS[tenant]}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def chat(port: int, tenant: str, system: str, question: str) -> None:
    status, text = request(port, "/v1/chat/completions", tenant, {
        "model": "smollm2", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert status == 200, text


def cluster(port: int, tenant: str) -> dict[str, Any]:
    status, text = request(port, "/v1/cluster", tenant)
    assert status == 200, text
    return json.loads(text)


def prefix_names(v: Views, tenant: str, system: str, question: str) -> set[str]:
    """Every name (the 16 hex digits /v1/cluster shows) of the tenant's prompt's block hashes."""
    caller = next(k for k in v.router.cfg.api_keys if k.key == KEYS[tenant])
    inp = GenerateInput("", None, None, (ChatMessage("system", system), ChatMessage("user", question)),
                        SamplingParams(max_tokens=1))
    hashes = v.lt.run(v.router.core.prepare(inp, caller)).route.block_hashes
    assert len(hashes) >= 2
    return {f"{h:032x}"[:16] for h in hashes}


@pytest.mark.server
def test_beta_cannot_read_alphas_prompt_hashes_or_counts_in_the_cluster_view(views: Views) -> None:
    alpha_names = prefix_names(views, "alpha", ALPHA_SYSTEM, "Who votes?")
    beta_names = prefix_names(views, "beta", BETA_SYSTEM, "Is there a night train from Vienna to Rome?")
    status, text = request(views.http, "/v1/cluster", "beta")
    assert status == 200
    assert SECRET not in text and "ALPHA" not in text and "alpha" not in text
    assert not any(name in text for name in alpha_names), "beta sees a hash of alpha's prompt"
    doc = json.loads(text)
    assert doc["scope"] == {"tenant": "beta", "admin": False}
    hot = doc["hot_prefixes"]
    assert hot and {p["tenant"] for p in hot} == {"beta"} and {p["prefix"] for p in hot} <= beta_names
    assert all(p["text"] is None for p in hot), "prompt previews are for admin keys only"
    assert doc["router"]["tenants"] == [{"tenant": "beta", "admitted": 1, "rejected": 0}]
    assert sum(r["count"] for r in doc["router"]["requests"]) == 1       # beta's one request
    # alpha sees its own prefix (no preview) and counts, none of beta's
    doc = cluster(views.http, "alpha")
    assert {p["tenant"] for p in doc["hot_prefixes"]} == {"alpha"}
    assert all(p["text"] is None for p in doc["hot_prefixes"])
    assert [t["tenant"] for t in doc["router"]["tenants"]] == ["alpha"]
    assert sum(r["count"] for r in doc["router"]["requests"]) == 2
    # the admin key sees both tenants, with previews
    doc = cluster(views.http, "ops")
    assert doc["scope"] == {"tenant": None, "admin": True}
    assert {p["tenant"] for p in doc["hot_prefixes"]} == {"alpha", "beta"}
    assert any(SECRET in (p["text"] or "") for p in doc["hot_prefixes"] if p["tenant"] == "alpha")
    assert {t["tenant"] for t in doc["router"]["tenants"]} == {"alpha", "beta"}
    assert sum(r["count"] for r in doc["router"]["requests"]) == 3
    assert request(views.http, "/v1/cluster")[0] == 401


def tenant_labels(text: str) -> set[str]:
    return set(re.findall(r'kvmesh:router_tenant_requests_total\{[^}]*tenant="([^"]+)"', text))


@pytest.mark.server
def test_metrics_without_a_key_show_no_tenant_names(views: Views) -> None:
    status, text = request(views.http, "/metrics")
    assert status == 200 and "kvmesh:router_requests_total" in text
    assert "alpha" not in text and "beta" not in text
    labels = tenant_labels(text)
    assert len(labels) == 2 and all(re.fullmatch(r"t-[0-9a-f]{16}", t) for t in labels)
    salts = views.router.core.salts
    assert labels == {salts.label_for("alpha"), salts.label_for("beta")}
    # the label is neither the tenant's salt nor a part of it (a label cannot be sent as cache_salt)
    for name in ("alpha", "beta"):
        key = next(k for k in views.router.cfg.api_keys if k.tenant == name)
        assert salts.label_for(name)[2:] not in salts.default_for(key)
    # stable: another router with the same keys gives the same ids
    assert salts.label_for("alpha") == TenantSalts(views.router.cfg.api_keys).label_for("alpha")
    # a tenant's key: its own series only, by name; the admin key: every tenant by name
    assert tenant_labels(request(views.http, "/metrics", "beta")[1]) == {"beta"}
    assert tenant_labels(request(views.http, "/metrics", "ops")[1]) == {"alpha", "beta"}
    # --metrics-tenant-names: names without a key
    assert tenant_labels(request(views.named_http, "/metrics")[1]) == {"alpha", "beta"}


@pytest.mark.server
def test_every_route_is_classified(views: Views) -> None:
    """A route added to the HTTP app must be classified (and checked) here."""
    app = views.router._http.app     # type: ignore[union-attr]
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert paths == SCOPED | STATELESS | GENERATING | ADMIN_ONLY


@pytest.mark.server
def test_no_other_route_tells_beta_about_alpha(views: Views) -> None:
    for path, body in (("/v1/models", None), ("/version", None), ("/openapi.json", None), ("/dashboard", None),
                       ("/health", None), ("/readyz", None), ("/live", None), ("/livez", None),
                       ("/tokenize", {"prompt": "Who votes?"}), ("/detokenize", {"tokens": [1, 2, 3]}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})):
        status, text = request(views.http, path, "beta", body)
        assert status == 200, (path, text)
        assert SECRET not in text and "alpha" not in text, path
    # /tokenize answers the same for every tenant: nothing of a tenant's cache in it
    assert (request(views.http, "/tokenize", "beta", {"prompt": ALPHA_SYSTEM})[1]
            == request(views.http, "/tokenize", "alpha", {"prompt": ALPHA_SYSTEM})[1])
    status, text = request(views.http, "/reset_prefix_cache", "beta", {})
    assert status == 403 and SECRET not in text
    # gRPC: model info carries no tenant; beta cannot abort (or learn of) a request it did not send
    with grpc.insecure_channel(f"127.0.0.1:{views.grpc}") as ch:
        stub = pb_grpc.RouterStub(ch)
        md = (("authorization", f"Bearer {KEYS['beta']}"),)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=md)
        assert SECRET not in str(info) and "alpha" not in str(info)
        assert not stub.Abort(pb.AbortRequest(request_id="alpha-anything"), timeout=30, metadata=md).found


@pytest.mark.server
def test_dashboard_shows_a_tenant_only_its_own(views: Views, browser: Any) -> None:  # noqa: F811
    base = f"http://127.0.0.1:{views.http}/dashboard"
    browser.get(f"{base}?key={KEYS['beta']}")
    wait_for("beta's view", lambda: page_values(browser).get("scope") == "beta")
    values = wait_for("a prefix row", lambda: [k for k in page_values(browser) if k.endswith(".tenant")])
    cells = page_values(browser)
    assert {cells[k] for k in values} == {"beta"}
    heat = browser.execute_script("return document.querySelector('#heat tbody').innerText")
    assert "beta: (prompt preview: admin keys only)" in heat
    assert SECRET not in browser.page_source and "alpha" not in browser.page_source
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{base}?key={KEYS['ops']}")
    wait_for("the admin's view", lambda: page_values(browser).get("scope") == "*")
    wait_for("alpha's prompt preview", lambda: SECRET in browser.page_source)
    cells = page_values(browser)
    assert {v for k, v in cells.items() if k.endswith(".tenant")} == {"alpha", "beta"}
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
