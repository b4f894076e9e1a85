"""CPU pinning for `kvmesh bench scale`: the router (the bench process — its consumer and its
picks) on one core, the worker fleet child and redis-server on the others, so that a pick is
not descheduled by the fleet or Redis, as a deployed router, with cores of its own, is not.
Other users' processes on the machine are not pinned away: the machine stays shared.

Linux `sched_setaffinity`: on a process it sets every thread's mask (each task under
/proc/PID/task: redis-server's background threads too); threads created later inherit their
creator's. With fewer than two cores nothing is pinned (`Pinning.skipped` says why).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("split", "none")


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which cores the router and the fleet + Redis run on (empty: not pinned)."""

    router: tuple[int, ...] = ()
    others: tuple[int, ...] = ()
    skipped: str = ""                   # why nothing is pinned ("" when pinned)
    restore: tuple[int, ...] = field(default=(), repr=False)   # the router thread's mask before

    @property
    def active(self) -> bool:
        return bool(self.router)

    def describe(self) -> dict[str, Any]:
        """What the JSON records (`config.pinning`)."""
        if not self.active:
            return {"pinned": False, "why": self.skipped}
        return {"pinned": True, "router_cpus": list(self.router), "fleet_cpus": list(self.others),
                "redis_cpus": list(self.others),
                "how": "os.sched_setaffinity: the bench process (router: consumer + picks) on router_cpus, "
                       "every thread of the fleet child and of redis-server on fleet_cpus / redis_cpus"}


def plan(mode: str, cpus: Iterable[int] | None = None) -> Pinning:
    """The split for `mode` over `cpus` (default: this process's allowed cores)."""
    if mode not in MODES:
        raise ValueError(f"pin={mode!r}; accepted: {', '.join(MODES)}")
    if not hasattr(os, "sched_setaffinity"):
        return Pinning(skipped="os.sched_setaffinity is not available on this platform")
    allowed = tuple(sorted(cpus if cpus is not None else os.sched_getaffinity(0)))
    if mode == "none":
        return Pinning(skipped="--pin none")
    if len(allowed) < 2:
        return Pinning(skipped=f"{len(allowed)} core allowed: nothing to split")
    return Pinning(router=allowed[:1], others=allowed[1:], restore=allowed)


def pin_process(pid: int, cpus: Iterable[int]) -> int:
    """Every thread of process `pid` onto `cpus`; returns how many threads were pinned (a
    thread that ended meanwhile is skipped)."""
    mask = set(cpus)
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]
    done = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
            done += 1
        except ProcessLookupError:
            continue
    return done


def pin_children(p: Pinning, pids: Iterable[int]) -> None:
    """The fleet's and Redis's processes onto `p.others` (nothing when not active)."""
    if p.active:
        for pid in pids:
            pin_process(pid, p.others)


def pin_router(p: Pinning) -> None:
    """This thread (the bench's: the router's event loop) onto `p.router`; threads it starts
    later (asyncio's executor) inherit it."""
    if p.active:
        os.sched_setaffinity(0, set(p.router))


def unpin_router(p: Pinning) -> None:
    """This thread back to the mask it had (the bench may run inside a test process)."""
    if p.active:
        os.sched_setaffinity(0, set(p.restore))
