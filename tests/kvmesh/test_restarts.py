"""kvmesh.serve.restarts: the restart policy's decisions (backoff, give-up window, clean exits)."""
from __future__ import annotations

import pytest

from kvmesh.serve.restarts import RestartConfig, RestartPolicy, RestartTracker, Verdict


def test_backoff_doubles_then_gives_up_after_five_deaths_in_the_window() -> None:
    t = RestartTracker(RestartConfig())
    decisions = [t.on_exit("worker-0", -9, now=float(i)) for i in range(5)]
    assert [d.verdict for d in decisions] == [Verdict.RESTART] * 4 + [Verdict.GIVE_UP]
    assert [d.delay_s for d in decisions[:4]] == [0.5, 1.0, 2.0, 4.0]
    assert t.on_exit("worker-1", 1, now=5.0).verdict is Verdict.RESTART   # per part


def test_deaths_outside_the_window_are_forgotten() -> None:
    t = RestartTracker(RestartConfig(max_deaths=2, window_s=10.0))
    assert t.on_exit("redis", -9, now=0.0).verdict is Verdict.RESTART
    assert t.on_exit("redis", -9, now=11.0) == (Verdict.RESTART, 0.5, 1)
    assert t.on_exit("redis", -9, now=12.0).verdict is Verdict.GIVE_UP


def test_policies() -> None:
    on_failure = RestartTracker(RestartConfig(policy=RestartPolicy.ON_FAILURE))
    assert on_failure.on_exit("router", 0, 0.0).verdict is Verdict.LEAVE
    assert on_failure.on_exit("router", None, 1.0).verdict is Verdict.RESTART
    always = RestartTracker(RestartConfig(policy=RestartPolicy.ALWAYS))
    assert always.on_exit("router", 0, 0.0).verdict is Verdict.RESTART
    never = RestartTracker(RestartConfig(policy=RestartPolicy.NEVER))
    assert never.on_exit("router", -9, 0.0).verdict is Verdict.END_RUN


def test_config_rejects_bad_values() -> None:
    from kvmesh.serve.config import ServeConfig
    for bad in (dict(max_deaths=0), dict(window_s=0.0), dict(policy="sometimes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RestartConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="restart_policy"):
        ServeConfig(restart_policy="sometimes")  # type: ignore[arg-type]
