"""`GET /dashboard` (router/observe/dashboard.py) in a real headless browser (Debian chromium through
selenium and /usr/bin/chromedriver) over a real router and SmolLM2 worker: the numbers on the
page equal `GET /v1/cluster`, the page updates itself after a request, the browser logs no
console error, and a screenshot is saved (the path is printed; `KVMESH_ARTIFACTS=<dir>` keeps it)."""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.router.test_router import LONG_PREFIX, Cluster

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
                                reason="needs Debian chromium and chromium-driver (make setup installs them)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1500,760",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def complete(port: int | None, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def page_values(driver: Any) -> dict[str, str]:
    return driver.execute_script(
        "const o = {}; for (const e of document.querySelectorAll('[data-field]')) o[e.dataset.field] = e.dataset.value;"
        "return o;")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"dashboard: {what} within {timeout} s"
        time.sleep(0.1)


def same_numbers(page: dict[str, str], doc: dict[str, Any]) -> list[str]:
    """The /v1/cluster numbers the page shows that differ from `doc` (empty: all equal)."""
    want: dict[str, Any] = {}
    for w in doc["workers"]:
        for k in ("prompt_tokens", "hit_rate", "kv_cache_usage", "host_tier_usage", "num_preemptions",
                  "num_running", "num_onloaded_blocks", "ttft_p50_s"):
            want[f"{w['worker_id']}.{k}"] = w[k]
    r = doc["router"]
    want["router.requests"] = sum(x["count"] for x in r["requests"])
    for k in ("predicted_hit_tokens", "served_hit_tokens", "hit_mismatches"):
        want[f"router.{k}"] = r[k]
    for p in doc["hot_prefixes"]:
        want[f"prefix.{p['prefix']}.requests"] = p["requests"]
    return [f"{k}: page {page.get(k)!r} vs {v!r}" for k, v in want.items()
            if page.get(k) is None or (v is None and page[k] != "null") or (v is not None and float(page[k]) != v)]


@pytest.mark.server
def test_dashboard_shows_cluster_json_and_updates(web: Cluster, browser: Any, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{web.http_port}"
    complete(web.http_port, LONG_PREFIX + "What is the capital of Austria?")
    browser.get(f"{base}/dashboard")
    wait_for("a worker row", lambda: "worker-0.prompt_tokens" in page_values(browser))
    doc = get_json(f"{base}/v1/cluster")
    wait_for(f"the numbers of /v1/cluster: {same_numbers(page_values(browser), doc)}",
             lambda: not same_numbers(page_values(browser), doc))
    before = float(page_values(browser)["worker-0.prompt_tokens"])

    answer = complete(web.http_port, LONG_PREFIX + "Which river flows through Budapest?")
    wait_for("an update after a request",
             lambda: float(page_values(browser)["worker-0.prompt_tokens"]) == before + answer["usage"]["prompt_tokens"])
    doc = get_json(f"{base}/v1/cluster")
    wait_for(f"the numbers of /v1/cluster after the request: {same_numbers(page_values(browser), doc)}",
             lambda: not same_numbers(page_values(browser), doc))
    hot = doc["hot_prefixes"][0]
    assert hot["requests"] >= 2 and hot["routed"] == {"worker-0": hot["requests"]}
    # without API keys the one tenant sees everything, previews included (tests/router/test_tenant_views.py: keys)
    assert doc["scope"] == {"tenant": None, "admin": True} and hot["tenant"] == "default"
    assert page_values(browser)["scope"] == "*"
    assert hot["text"] and LONG_PREFIX.startswith(hot["text"].lstrip())
    cells = page_values(browser)
    assert float(cells[f"prefix.{hot['prefix']}.worker-0"]) == 1.0     # every request of it went there
    assert doc["workers"][0]["ttft_samples"] >= 2 and doc["workers"][0]["ttft_p99_s"] >= doc["workers"][0]["ttft_p50_s"]

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    keep = os.environ.get("KVMESH_ARTIFACTS")
    if keep:
        shutil.copy(shot, Path(keep) / "dashboard.png")
    print(f"dashboard screenshot: {shot}")


@pytest.mark.server
def test_dashboard_page_is_self_contained(web: Cluster) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{web.http_port}/dashboard", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/html")
        html = resp.read().decode()
    assert "/v1/cluster" in html and "setInterval(refresh, 1000)" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    assert "<script src" not in html and "<link rel=\"stylesheet\"" not in html
