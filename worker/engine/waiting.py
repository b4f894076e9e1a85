"""The scheduler's queue of waiting requests, in admission order."""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from worker.engine.request import Request


class WaitingQueue:
    """Waiting requests in admission order: (priority, arrival_time, insertion), lowest first.
    A preempted request keeps its arrival time, so it goes back ahead of later arrivals."""

    def __init__(self) -> None:
        self._items: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in self._items)

    def add(self, req: Request) -> None:
        bisect.insort(self._items, (req.priority, req.arrival_time, next(self._seq), req),
                      key=lambda item: item[:3])

    def peek(self) -> Request:
        return self._items[0][3]

    def pop(self) -> Request:
        return self._items.pop(0)[3]

    def remove(self, req: Request) -> None:
        for i, item in enumerate(self._items):
            if item[3] is req:
                del self._items[i]
                return
        raise ValueError(f"request {req.request_id!r} is not waiting")
