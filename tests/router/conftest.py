"""Fixtures shared by the router's HTTP-facing test files."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.test_router import Cluster, start_cluster, stop_cluster


@pytest.fixture(scope="module")
def web(smollm2_dir: Path) -> Iterator[Cluster]:
    """One worker and a router with HTTP, per test module."""
    c = start_cluster(smollm2_dir, 1, http=True)
    try:
        yield c
    finally:
        stop_cluster(c)
