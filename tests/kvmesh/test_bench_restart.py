"""`kvmesh bench restart` (kvmesh/bench/restart.py): its window arithmetic on recorded requests,
its flags, and (slow) one real run of the `with` mode on short windows."""
from __future__ import annotations

import argparse

import pytest

from kvmesh.bench import restart
from kvmesh.bench.restart import Record, RestartConfig, _event, _fraction


def test_event_compares_the_cached_fraction_after_with_before_and_finds_the_first_hit():
    records = [Record(1.0, "w-0", 100, 90), Record(2.0, "w-1", 100, 90),        # before t = 5
               Record(6.0, "w-0", 100, 0), Record(7.0, "w-1", 100, 0, "UNAVAILABLE"),
               Record(8.0, "w-1", 100, 45), Record(20.0, "w-1", 100, 90)]      # the last is past the window
    ev = _event(records, 5.0, 5.0, "w-1")
    assert ev["cached_before"] == 0.9 and ev["cached_after"] == 45 / 200       # the failed one is not counted
    assert ev["cached_ratio"] == pytest.approx(0.25) and ev["errors_after"] == 1
    assert ev["first_hit_s"] == 3.0 and ev["requests_after"] == 3
    assert _fraction([]) is None and _event([], 5.0, 5.0, "w-1")["cached_ratio"] is None


def test_flags_and_config():
    p = argparse.ArgumentParser()
    restart.register(p.add_subparsers())
    args = p.parse_args(["restart", "--quick", "--clients", "2"])
    assert args.run is restart.run and args.quick and args.clients == 2
    assert restart.QUICK.window_s == 20.0
    with pytest.raises(ValueError, match="window_s"):
        RestartConfig(window_s=0)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_short_run_reports_every_event(tmp_path):
    cfg = RestartConfig(window_s=8.0, num_prefixes=4, prefix_tokens=64, clients=2, log_dir=str(tmp_path))
    out = restart.run_restart(cfg, ("with",), quick=True)
    for key in ("restart", "drain", "scale_out"):
        assert out[key] == out["with"][key]
    assert out["with"]["drain"]["drained_exit_code"] == 0 and out["with"]["scale_out"]["first20_requests"] == 20
    assert out["drain"]["cached_ratio"] is not None and out["restart"]["cached_ratio"] is not None


def test_docs_render_the_ratios_with_and_without():
    from kvmesh.bench.docs_figures import bench_of, figures_of
    side = {"restart": {"cached_ratio": 0.95}, "drain": {"cached_ratio": 0.5}, "scale_out": {}, "errors": 0}
    result = {"with": {**side, "drain": {"cached_ratio": 0.97, "first_hit_s": 1.5}}, "without": side,
              "window_s": 20.0, "targets": restart.TARGETS}
    assert bench_of({}, result) == "restart"
    baseline, figures = figures_of("restart", result)
    assert "20 s windows" in baseline
    drain = next(f for f in figures if f.name.startswith("after a SIGTERM drain"))
    assert (drain.value, drain.baseline, drain.versus) == ("0.97x", "0.50x without", "target >= 0.9x")
    assert next(f for f in figures if f.name.startswith("scale-out")).value == "—"      # missing: a dash
