"""Is the engine loop making progress? Liveness of one worker, apart from its readiness.

- `EnginePulse`: written by the engine thread only (`AsyncEngine._loop`): a heartbeat
  (monotonic time) on every loop iteration, idle waits included, and the count of engine
  steps that raised in a row (a successful step resets it). Plain attribute writes: readers on
  other threads see a recent value, which is all a timeout needs.
- `Liveness`: the verdict over a pulse — not live once the heartbeat is older than
  `timeout_s` (a hung device, a deadlock) or `max_step_failures` steps in a row raised (a
  sticky CUDA error). The verdict is sticky: a worker that was found not live stays so (the
  kubelet restarts the pod; nothing in the process can vouch for the device again), and it is
  logged once, at ERROR, by whichever caller found it first. Before a pulse is attached (the
  model is loading) the worker is live: the startup probe covers loading.
- `watch`: the watchdog, a task on the server's event loop that returns the reason as soon as
  the verdict turns.

Torch-free and gRPC-free; the server (worker/server/service.py) acts on the verdict, worker/server/health.py
publishes it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvmesh.worker")


class EnginePulse:
    """What the engine thread reports: `beat()` every loop iteration, `step_ok()` /
    `step_failed(error)` after every step. Read from any thread."""

    __slots__ = ("last_beat", "step_failures", "last_error", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.last_beat = clock()
        self.step_failures = 0          # consecutive
        self.last_error = ""

    def beat(self) -> None:
        self.last_beat = self._clock()

    def step_ok(self) -> None:
        if self.step_failures:
            self.step_failures = 0

    def step_failed(self, error: BaseException) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        self.step_failures += 1


class Liveness:
    """The sticky verdict over one `EnginePulse` (see the module docstring). Thread-safe:
    the HTTP probe thread and the event loop both ask."""

    def __init__(self, timeout_s: float, max_step_failures: int,
                 clock: Callable[[], float] = time.monotonic, worker_id: str = "worker") -> None:
        if not timeout_s > 0:
            raise ValueError(f"liveness_timeout_s={timeout_s!r} must be > 0")
        if isinstance(max_step_failures, bool) or not isinstance(max_step_failures, int) or max_step_failures < 1:
            raise ValueError(f"max_step_failures={max_step_failures!r} must be an integer >= 1")
        self.timeout_s = timeout_s
        self.max_step_failures = max_step_failures
        self._clock = clock
        self.worker_id = worker_id
        self._pulse: EnginePulse | None = None
        self._reason: str | None = None
        self._lock = threading.Lock()

    def attach(self, pulse: EnginePulse) -> None:
        """Judge `pulse` from now on (the engine thread has started)."""
        self._pulse = pulse

    def check(self) -> str | None:
        """None while live, else why not (and from then on always that reason). A query that
        may record the verdict: the first reason found is the one kept."""
        if self._reason is not None:
            return self._reason
        pulse = self._pulse
        if pulse is None:
            return None
        reason = None
        age = self._clock() - pulse.last_beat
        failures = pulse.step_failures
        if age > self.timeout_s:
            reason = (f"the engine loop has not made progress for {age:.1f} s "
                      f"(--liveness-timeout-s {self.timeout_s:g})")
        elif failures >= self.max_step_failures:
            reason = (f"{failures} engine steps in a row raised (--max-step-failures "
                      f"{self.max_step_failures}); the last: {pulse.last_error}")
        if reason is None:
            return None
        with self._lock:
            if self._reason is not None:
                return self._reason
            self._reason = reason
        log.error("WORKER %s IS NOT LIVE: %s. Liveness and readiness are NOT_SERVING for good, it leaves "
                  "the registry and refuses engine calls; restart it (the kubelet does).", self.worker_id, reason)
        return reason


async def watch(liveness: Liveness, period_s: float | None = None) -> str:
    """Return the reason once `liveness` turns not live, checking every `period_s` (default:
    a quarter of the timeout, at most 1 s)."""
    period = period_s if period_s is not None else min(1.0, liveness.timeout_s / 4)
    while (reason := liveness.check()) is None:
        await asyncio.sleep(period)
    return reason
