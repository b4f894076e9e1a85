"""`kvmesh bench scale`: its flags, and a tiny real run (redis-server, a worker fleet child, the
router's consumer and index in the test process) whose figures are checked against an oracle."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.cli import CLIError
from kvmesh.bench.scale import ScaleConfig, bottleneck, config_from_args, register
from kvmesh.bench.scale_memory import deep_size
from kvmesh.bench.scale_pin import pin_process, plan
from kvmesh.cli import main
from tests.support.redis_server import REDIS_SERVER

RUN_KEYS = {"workers", "blocks", "decision_p50_ms", "decision_p99_ms", "event_lag_p99_ms", "index_bytes_per_entry",
            "events_per_s_per_core", "redis_cpu_frac", "redis_mem_bytes"}


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["scale", *argv])


def test_flags_and_their_errors() -> None:
    cfg = config_from_args(_parse("--quick", "--workers", "4,8", "--steady-s", "1.5"))
    assert (cfg.workers, cfg.steady_s, cfg.decision_rate, cfg.indexes) == ((4, 8), 1.5, 20.0,
                                                                        ("legacy", "compact-dicts", "compact-tracked",
                                                                         "compact-per-pick", "compact-asks-loop",
                                                                         "compact"))
    assert config_from_args(_parse()).workers == ScaleConfig().workers == (16, 128, 1000)
    with pytest.raises(CLIError, match="--index: indexes"):
        config_from_args(_parse("--index", "legacy,btree"))
    with pytest.raises(CLIError, match="--pool-blocks: pool_blocks"):
        config_from_args(_parse("--pool-blocks", "10"))
    with pytest.raises(CLIError, match="--decision-rate: "):
        config_from_args(_parse("--decision-rate", "-1"))


def test_an_unwritable_json_path_is_refused_before_the_bench_runs(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """No redis-server, no fleet: `kvmesh bench` checks `--json` first (kvmesh/bench/report.py)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "scale", "--quick", "--json", str(blocker / "out.json")]) == 2
    assert "--json: cannot create" in capsys.readouterr().err
    assert main(["bench", "scale", "--quick", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--workers", "4,many")


def test_the_pinning_splits_the_router_from_the_fleet_and_redis() -> None:
    split = plan("split", [0, 1, 2])
    assert (split.router, split.others, split.active) == ((0,), (1, 2), True)
    assert split.describe()["router_cpus"] == [0] and split.describe()["redis_cpus"] == [1, 2]
    one = plan("split", [3])
    assert not one.active and "1 core" in one.skipped and one.describe() == {"pinned": False, "why": one.skipped}
    assert not plan("none", [0, 1]).active
    with pytest.raises(ValueError, match="pin"):
        plan("half")
    with pytest.raises(ValueError, match="pin"):
        ScaleConfig(pin="half")
    assert config_from_args(_parse("--pin", "none")).pin == "none" and ScaleConfig().pin == "split"
    with pytest.raises(SystemExit):
        _parse("--pin", "half")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to pin to")
def test_pin_process_moves_every_thread_of_a_child() -> None:
    code = ("import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
            "print(1, flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        core = max(os.sched_getaffinity(0))
        assert pin_process(child.pid, [core]) == 2
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert all(os.sched_getaffinity(t) == {core} for t in tids)
    finally:
        child.kill()
        child.wait()


def test_the_bottleneck_is_named_at_the_targets_scale_first_and_smaller_misses_as_such() -> None:
    def row(n: int, **over: float) -> dict[str, object]:
        base = {"decision_p99_ms": 1.5, "event_lag_p99_ms": 100.0, "index_bytes_per_entry": 150.0,
                "decision_p50_ms": 1.0, "events_per_s_per_core": 9e4, "redis_cpu_frac": 0.2}
        return {"workers": n, "_index": "compact", **base, **over}
    details = [{"workers": n, "index": "compact", "decision_parts_ms": {"pick": 1.0}} for n in (16, 1000, 2000)]
    assert bottleneck([row(16), row(1000)], details) == "none of the targets missed at 1,000+ workers"
    text = bottleneck([row(16, index_bytes_per_entry=331.5), row(1000)], details)
    assert text.startswith("none of the targets missed at 1,000+ workers; below that scale: "
                           "index_bytes_per_entry 331.5 > 200.0 at 16 workers")
    text = bottleneck([row(16, decision_p99_ms=3.0), row(1000), row(2000, event_lag_p99_ms=900.0)], details)
    assert text.startswith("event_lag_p99_ms 900.0 > 250.0 at 2000 workers") and "below that scale: decision" in text
    assert bottleneck([row(16)], details).startswith("no size at the targets' scale")


def test_the_size_walk_counts_shared_objects_once() -> None:
    key = 2**100
    d = {key: 1}
    assert deep_size((d, key)) == deep_size((d,)) + 8      # one more tuple slot; the key again costs nothing
    assert deep_size({key: [1, 2]}) > deep_size(d)


@pytest.mark.redis
@pytest.mark.multiproc
def test_a_tiny_run_reports_every_figure_and_its_index_matches_the_fleet(tmp_path: Path) -> None:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed")
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--workers", "8", "--pool-blocks", "100", "--steady-s", "1.5",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "machine" in result["meta"]
    assert result["config"]["pinning"]["pinned"] == (len(os.sched_getaffinity(0)) >= 2)
    assert isinstance(result["bottleneck"], str) and result["bottleneck"]
    assert set(result["baseline"]) == {"legacy", "compact-dicts", "compact-tracked", "compact-per-pick",
                                       "compact-asks-loop"}
    for runs in (result["runs"], *result["baseline"].values()):
        assert [r["workers"] for r in runs] == [8]
        for r in runs:
            assert set(r) == RUN_KEYS
            assert 0 < r["blocks"] <= r["workers"] * 100
            assert 0 < r["decision_p50_ms"] <= r["decision_p99_ms"] < 10_000
            assert 0 <= r["event_lag_p99_ms"] < 60_000
            assert 50 < r["index_bytes_per_entry"] < 20_000
            assert r["events_per_s_per_core"] > 0 and r["redis_mem_bytes"] > 0
            assert 0 <= r["redis_cpu_frac"] <= 2.0
    for d in result["details"]:
        fleet = d["fleet"]
        # the oracle: every worker's pool is full, so what it published (its inventory, then
        # stored minus removed) adds up to the pool size; the index holds exactly that
        assert fleet["stored"] == fleet["removed"] > 0
        assert d["index_entries"] == d["oracle_held"] == fleet["held"] == d["workers"] * 100
        assert d["decisions"] > 0 and d["consumer_gaps"] == 0
        assert 0 < d["decision_cpu_p50_ms"] <= d["decision_cpu_p99_ms"]
        assert 0 < d["dispatch_p50_ms"] <= d["dispatch_p99_ms"] < 10_000
        assert 0 <= d["gc_full_passes"] <= d["gc_passes"] and 0 <= d["decisions_with_gc"] <= d["decisions"]
        assert 0 < d["decision_p99_less_gc_ms"] and 0 < d["gc_collect_full_index_ms"] < 10_000
    by = {(d["workers"], d["index"]): d for d in result["details"]}
    assert by[8, "compact"]["index_bytes"] < by[8, "legacy"]["index_bytes"]


def test_a_fleet_that_died_is_named_not_a_broken_pipe() -> None:
    """The fleet child killed mid-run: `send` says it exited (with its code) and `close` does not
    hide that error behind a BrokenPipeError (`kvmesh bench scale` then prints it, exit 1)."""
    from kvmesh.bench.scale import _FleetProcess
    fleet = _FleetProcess.__new__(_FleetProcess)
    fleet.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    fleet.proc.wait()
    with pytest.raises(RuntimeError, match=r"exited \(code 3\) before 'pause'"):
        fleet.send("pause")
    assert fleet.close() == {}
