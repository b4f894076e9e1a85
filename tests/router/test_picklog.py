"""`kvmesh router --pick-log`: a JSON line per pick (what the policy saw) and per finish."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.flags import add_routing_arguments, routing_argv, routing_config
from router.observe.picklog import PickLog
from router.routing.observer import RouteObserver
from router.routing.types import RouteRequest, RoutingState, WorkerId, WorkerLoad


class _Heard(RouteObserver):
    def __init__(self) -> None:
        self.events: list[str] = []

    def picked(self, request_id: str, route: RouteRequest, worker_id: str) -> None:
        self.events.append(f"picked {request_id} {worker_id}")

    def finished(self, request_id, worker_id, final, ttft_s, total_s) -> None:  # type: ignore[no-untyped-def]
        self.events.append(f"finished {request_id}")

    def hit_predicted(self, worker_id: str, error: float) -> None:
        self.events.append(f"hit {worker_id} {error}")


class _Core:
    def __init__(self, state: RoutingState) -> None:
        self.state = state
        self.asked: list[RouteRequest] = []

    def routing_state(self, route: RouteRequest) -> RoutingState:
        self.asked.append(route)
        return self.state


def test_a_pick_and_a_finish_are_one_line_each_and_the_wrapped_observer_hears_everything(tmp_path: Path) -> None:
    state = RoutingState({WorkerId("w0"): WorkerLoad(3, 10, 64, 0, 12.5), WorkerId("w1"): WorkerLoad(1, 50, 64)},
                         {WorkerId("w0"): 2}, {WorkerId("w1"): 48}, 16, {WorkerId("w0"): 2.5},
                         {WorkerId("w1"): 2}, 0.375)
    inner, core = _Heard(), _Core(state)
    path = tmp_path / "picks.jsonl"
    log = PickLog(inner, core, str(path))
    route = RouteRequest(tuple(range(40)), (0xABCDEF0123456789 << 64 | 7, 5))
    log.picked("r1", route, "w0")
    log.finished("r1", "w0", pb.GenerateResponse(prompt_tokens=40, cached_tokens=32, peer_cached_tokens=16), 0.1, 0.5)
    log.hit_predicted("w0", 0.25)
    log.close()
    log.picked("r2", route, "w1")               # closed: the observer still hears it, nothing written
    pick, finish = (json.loads(line) for line in path.read_text().splitlines())
    assert pick["event"] == "pick" and pick["request_id"] == "r1" and pick["worker"] == "w0"
    assert pick["prefix"] == "abcdef0123456789" and pick["blocks"] == 2 and pick["cluster_committed"] == 0.375
    assert pick["workers"]["w0"] == {"cached": 2, "fetchable": 0, "in_flight": 3, "queued_tokens": 0,
                                     "mean_in_flight": 2.5, "shared_blocks": 12.5, "free_blocks": 10}
    assert pick["workers"]["w1"]["fetchable"] == 2 and pick["workers"]["w1"]["queued_tokens"] == 48
    assert finish == {"event": "finish", "t": finish["t"], "request_id": "r1", "worker": "w0",
                      "prompt_tokens": 40, "cached_tokens": 32, "peer_cached_tokens": 16, "ttft_s": 0.1,
                      "total_s": 0.5}
    assert core.asked == [route, route]
    assert inner.events == ["picked r1 w0", "finished r1", "hit w0 0.25", "picked r2 w1"]


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_routing_arguments(p)
    return p.parse_args(list(argv))


def test_the_flag_sets_the_config_passes_through_kvmesh_serve_and_a_bad_path_names_it(tmp_path: Path) -> None:
    path = str(tmp_path / "picks.jsonl")
    assert routing_config(_parse("--pick-log", path)).pick_log == path
    assert routing_config(_parse()).pick_log is None
    assert routing_argv(_parse("--pick-log", path)) == ("--pick-log", path)
    for bad, why in ((str(tmp_path), "is a directory"), (str(tmp_path / "no" / "picks.jsonl"), "does not exist")):
        with pytest.raises(ValueError, match=f"--pick-log: .*{why}"):
            routing_config(_parse("--pick-log", bad))


def test_a_full_disk_stops_the_log_and_never_fails_the_routing(caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full opens for appending but every write fails (ENOSPC): the pick still reaches the
    wrapped observer, one warning says the log stopped, later picks write nothing and raise nothing."""
    state = RoutingState({WorkerId("w0"): WorkerLoad(0, 10, 64)})
    inner = _Heard()
    log = PickLog(inner, _Core(state), "/dev/full")
    route = RouteRequest((1, 2, 3), ())
    with caplog.at_level("WARNING", logger="kvmesh.router"):
        log.picked("r1", route, "w0")
        log.picked("r2", route, "w0")
        log.close()
    assert inner.events == ["picked r1 w0", "picked r2 w0"]
    assert [r.getMessage() for r in caplog.records if "--pick-log" in r.getMessage()] == \
        ["--pick-log: writing failed (No space left on device); the pick log stops here"]
