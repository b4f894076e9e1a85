"""Each test's call report on its item (`item.rep_call`), so a fixture can tell whether the test
failed (tests/podnet.py's clusters print their pods' log tails then)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
