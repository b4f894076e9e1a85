"""A failed test that ran on a pod cluster (tests/support/podnet.py, fixture `cl`) prints its pods' log tails."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("cl")
    if report.when == "call" and report.failed and hasattr(cluster, "log_tails"):
        print(cluster.log_tails())
