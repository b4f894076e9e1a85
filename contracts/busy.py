"""Which tenants are busy: units (requests, sequences) in flight, or the last one ended within
`window_s` (`TENANT_BUSY_WINDOW_S` by default). The router counts the tenants busy on it
(router.security.tenancy) and each worker the tenants sharing its steps (worker.engine.fairness).
Single-threaded; the clock is injectable."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from contracts.requests import TENANT_BUSY_WINDOW_S


class BusyTenants:
    def __init__(self, window_s: float = TENANT_BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s >= 0:
            raise ValueError(f"window_s={window_s!r} must be >= 0")
        self.window_s = window_s
        self.clock = clock
        self._in_flight: dict[str, int] = {}
        self._last_busy: dict[str, float] = {}   # tenant -> when its last unit ended

    @property
    def in_flight(self) -> Mapping[str, int]:
        """Units in flight per tenant (only tenants with some)."""
        return self._in_flight

    def arrive(self, tenant: str, n: int = 1) -> None:
        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + n

    def leave(self, tenant: str) -> None:
        n = self._in_flight.get(tenant, 0) - 1
        assert n >= 0, f"tenant {tenant!r} left more than arrived"
        if n:
            self._in_flight[tenant] = n
        else:
            del self._in_flight[tenant]
            self._last_busy[tenant] = self.clock()

    def busy(self) -> set[str]:
        """The tenants in flight or ended within `window_s` (forgets the others)."""
        now = self.clock()
        for tenant, at in list(self._last_busy.items()):
            if now - at > self.window_s:
                del self._last_busy[tenant]
        return self._in_flight.keys() | self._last_busy.keys()
