"""The restart policy of `kvmesh serve`: whether a part that exited is started again, after
how long, and when to give up on it. Pure bookkeeping (no processes, no clock of its own):
`kvmesh.serve.supervise.Supervisor` owns one `RestartTracker` and feeds it each exit with the time.

Backoff doubles per recent death (0.5 s, 1 s, 2 s, ... capped at `max_backoff_s`); a part that
died `max_deaths` times within `window_s` is given up on (the rest of the cluster keeps serving).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class RestartPolicy(enum.Enum):
    """`--restart-policy`: ALWAYS restarts any exit, ON_FAILURE only a non-zero (or unknown)
    exit status, NEVER ends the whole run on the first exit of any child."""

    ALWAYS = "always"
    ON_FAILURE = "on-failure"
    NEVER = "never"


class Verdict(enum.Enum):
    RESTART = "restart"
    LEAVE = "leave"          # a clean exit under on-failure: not restarted, the rest go on
    GIVE_UP = "give-up"      # it keeps dying: not restarted, the rest go on
    END_RUN = "end-run"      # policy never: the whole run ends


class Decision(NamedTuple):
    verdict: Verdict
    delay_s: float           # when RESTART: wait this long first
    deaths: int              # deaths of this part within the window, this one included


@dataclass(frozen=True, slots=True)
class RestartConfig:
    policy: RestartPolicy = RestartPolicy.ON_FAILURE
    max_deaths: int = 5
    window_s: float = 60.0
    base_backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, RestartPolicy):
            raise ValueError(f"restart_policy={self.policy!r} must be one of "
                             f"{', '.join(p.value for p in RestartPolicy)}")
        if not isinstance(self.max_deaths, int) or self.max_deaths < 1:
            raise ValueError(f"max_deaths={self.max_deaths!r} must be >= 1")
        for name in ("window_s", "base_backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")


@dataclass(eq=False)
class RestartTracker:
    """Deaths per part name (times from the caller's monotonic clock) and what each exit means."""

    cfg: RestartConfig
    _deaths: dict[str, deque[float]] = field(default_factory=dict)

    def on_exit(self, name: str, returncode: int | None, now: float) -> Decision:
        """Record one exit of `name` (`returncode` None = unknown, counted as a failure)."""
        if self.cfg.policy is RestartPolicy.NEVER:
            return Decision(Verdict.END_RUN, 0.0, 0)
        deaths = self._deaths.setdefault(name, deque())
        deaths.append(now)
        while deaths and deaths[0] < now - self.cfg.window_s:
            deaths.popleft()
        if self.cfg.policy is RestartPolicy.ON_FAILURE and returncode == 0:
            return Decision(Verdict.LEAVE, 0.0, len(deaths))
        if len(deaths) >= self.cfg.max_deaths:
            return Decision(Verdict.GIVE_UP, 0.0, len(deaths))
        delay = min(self.cfg.base_backoff_s * 2 ** (len(deaths) - 1), self.cfg.max_backoff_s)
        return Decision(Verdict.RESTART, delay, len(deaths))
