"""Fixtures shared by the worker tests."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.loop_thread import LoopThread


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test with torch on 1 and on 2 threads (the kernels split work per thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    """One asyncio loop thread per test module, for the servers a module starts."""
    lt = LoopThread()
    yield lt
    lt.close()
