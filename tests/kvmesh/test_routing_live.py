"""`kvmesh bench routing-live`: flags, the per-policy figures from what the client saw, and
(slow) a tiny run through real clusters."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.cli import CLIError
from kvmesh.bench.routing_live import (
    LiveConfig,
    Workload,
    _Served,
    arrival_times,
    config_from_args,
    make_workload,
    send_all,
    summarize,
)
from kvmesh.bench.routing_live_figures import PICK_CLASSES, pick_log_figures
from kvmesh.bench.routing_live_probes import cpu_seconds, since
from kvmesh.cli import build_parser

KEYS = {"ttft_p50_s", "ttft_p99_s", "itl_p50_s", "req_s", "output_tok_s", "cached_token_frac", "cold_requests",
        "min_cold_requests", "max_cached_token_frac", "requests_per_worker_per_prefix", "requests_per_worker",
        "mismatch_rate"}


def _args(*argv: str) -> LiveConfig:
    return config_from_args(build_parser().parse_args(["bench", "routing-live", *argv]))


def test_flags_and_their_errors() -> None:
    cfg = _args("--quick", "--prefixes", "3", "--num-blocks", "200", "--policies", "kv_aware,round_robin")
    assert (cfg.prefixes, cfg.num_blocks, [p.value for p in cfg.policies]) == (3, 200, ["kv_aware", "round_robin"])
    assert cfg.prefix_tokens == 256 and _args().prefix_tokens == 512    # --quick is smaller
    with pytest.raises(CLIError, match="--concurrency"):
        _args("--concurrency", "0")
    with pytest.raises(CLIError, match="--policies"):
        _args("--policies", "fastest")
    with pytest.raises(CLIError, match="--scenarios"):
        _args("--scenarios", "heavy")
    assert _args().log_dir is None
    with pytest.raises(CLIError, match="--log-dir"):
        _args("--log-dir", "/proc/kvmesh-not-a-dir")


def test_same_workload_for_every_policy() -> None:
    cfg = LiveConfig(prefixes=3, prefix_tokens=32, question_tokens=4, requests=10)
    w: Workload = make_workload(cfg, 3)
    assert w == make_workload(cfg, 3) and len(w.requests) == 10 and len(w.prefixes) == 3
    assert all(len(p) == 32 for p in w.prefixes) and all(len(q) == 4 for _, q in w.requests)


def test_request_rate_draws_the_same_poisson_arrivals_for_every_policy() -> None:
    closed = _args("--quick")
    assert closed.request_rate == 0.0 and make_workload(closed, 4).arrivals == ()     # a closed loop by default
    cfg = _args("--quick", "--request-rate", "5")
    w = make_workload(cfg, 4)
    assert w.arrivals == make_workload(cfg, 4).arrivals and len(w.arrivals) == cfg.requests
    assert all(b > a for a, b in zip(w.arrivals, w.arrivals[1:])) and w.arrivals[0] > 0
    # the prompts are those of the closed loop: only the send times differ
    assert (w.prefixes, w.requests) == (make_workload(closed, 4).prefixes, make_workload(closed, 4).requests)
    gaps = [b - a for a, b in zip((0.0, *arrival_times(5.0, 4000, 1)), arrival_times(5.0, 4000, 1))]
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.05)                 # exponential, mean 1 / rate
    assert sum(g > 0.2 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.03)   # P(gap > mean) = 1/e
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(CLIError, match="--request-rate"):
            _args("--request-rate", bad)


def test_send_all_keeps_the_arrival_times_and_the_concurrency_bound() -> None:
    import asyncio
    import time

    async def go(arrivals: tuple[float, ...], limit: int, hold: float) -> tuple[list[float], int]:
        start, busy, most = time.perf_counter(), [0], [0]

        def send(i: int) -> Any:
            async def run() -> float:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
                sent = time.perf_counter() - start
                await asyncio.sleep(hold)
                busy[0] -= 1
                return sent
            return run
        out = await send_all([send(i) for i in range(4)], arrivals, asyncio.Semaphore(limit))
        return out, most[0]

    # an open loop: each request goes out at its time, not when another finishes
    sent, most = asyncio.run(go((0.05, 0.25, 0.45, 0.65), 4, 0.3))
    assert all(a <= s < a + 0.1 for a, s in zip((0.05, 0.25, 0.45, 0.65), sent)) and most == 2
    # the bound still holds: a request that finds every slot taken waits for one
    sent, most = asyncio.run(go((0.0, 0.0, 0.0, 0.0), 2, 0.2))
    assert most == 2 and sorted(sent)[2] >= 0.2
    # a closed loop: all at once, at most `limit` in flight
    sent, most = asyncio.run(go((), 3, 0.1))
    assert most == 3 and sorted(sent)[:3] == pytest.approx([0, 0, 0], abs=0.05) and sorted(sent)[3] >= 0.1


def test_summarize_counts_cold_requests_and_placement() -> None:
    cfg = LiveConfig(prefixes=2, prefix_tokens=40, question_tokens=8, output_tokens=3)
    full = 32   # 40 prefix tokens: 2 full blocks of 16
    served = [_Served(0, "w0", 0.0, 2.0, 1.0, [0.1, 0.3], 48, 0, 3),        # cold: computed its prefix
              _Served(0, "w0", 0.5, 2.5, 0.5, [0.1, 0.1], 48, full, 3),
              _Served(1, "w1", 0.0, 1.0, 0.8, [0.2, 0.2], 48, 16, 3),       # half its prefix: cold
              _Served(1, "w0", 1.0, 4.0, 0.2, [0.1, 0.1], 48, full, 3)]
    out = summarize(cfg, 2, served, 4.0, {"requests": 4, "hit_mismatches": 1})
    assert KEYS <= set(out)
    assert out["cold_requests"] == 2 and out["min_cold_requests"] == 2
    assert out["requests_per_worker_per_prefix"] == {"0": {"w0": 2}, "1": {"w0": 1, "w1": 1}}
    assert out["requests_per_worker"] == {"w0": 3, "w1": 1}
    assert out["cached_token_frac"] == pytest.approx((2 * full + 16) / (4 * 48))
    assert out["req_s"] == 1.0 and out["output_tok_s"] == 3.0 and out["mismatch_rate"] == 0.25
    assert out["ttft_p50_s"] == pytest.approx(0.65) and out["ttft_p99_s"] == 1.0 and out["itl_p50_s"] == 0.1
    assert out["diagnostics"]["mean_in_flight_per_worker"] == {"w0": 1.75, "w1": 0.25}
    # warm: the 2nd waited [0.5, 1.0] on w0 while the 1st did [0, 1.0]; the 4th [1.0, 1.2] alone
    assert out["diagnostics"]["warm_prefill_overlap"] == 0.5
    # the ceiling: each prefix's first request computes it, every later one finds its full blocks
    assert out["max_cached_token_frac"] == pytest.approx(2 * full / (4 * 48))


def test_summarize_minimum_and_ceiling_count_the_prefixes_asked() -> None:
    """A phase's draw may leave a prefix out (the quick shift's second phase asks for 11 of its
    12): the minimum of cold requests and the ceiling of the cached fraction count the prefixes
    the requests asked for, in the order they were sent, and a prompt's last token is never cached."""
    cfg = LiveConfig(prefixes=3, prefix_tokens=32, question_tokens=8, output_tokens=3)
    served = [_Served(2, "w0", 0.0, 1.0, 0.5, [0.1], 40, 0, 2),
              _Served(0, "w1", 0.1, 1.0, 0.5, [0.1], 40, 0, 2),
              _Served(2, "w1", 0.2, 1.0, 0.5, [0.1], 40, 0, 2),      # cold, where a perfect router hits
              _Served(0, "w1", 0.3, 1.0, 0.5, [0.1], 40, 32, 2),
              _Served(0, "w1", 0.4, 1.0, 0.5, [0.1], 32, 16, 2)]     # a prompt of the prefix alone
    out = summarize(cfg, 3, served, 1.0, {"requests": 5})
    assert out["min_cold_requests"] == 2 and out["cold_requests"] == 4
    # the 3rd and 4th could find 32 tokens, the 5th 16 (its 2nd block holds its last token)
    assert out["max_cached_token_frac"] == pytest.approx((32 + 32 + 16) / (4 * 40 + 32))
    assert out["cached_token_frac"] == pytest.approx(48 / (4 * 40 + 32))


def test_shift_phases_draw_new_prefixes_and_count_the_router_since_the_fill() -> None:
    cfg = LiveConfig(prefixes=3, prefix_tokens=32, question_tokens=4, requests=10)
    fill, shifted = make_workload(cfg, 3, phase=1), make_workload(cfg, 3, phase=2)
    assert not set(fill.prefixes) & set(shifted.prefixes) and fill != make_workload(cfg, 3)
    assert fill == make_workload(cfg, 3, phase=1)
    assert _args("--scenarios", "shift").scenarios == ("shift",)
    before = {"requests": 10, "hit_mismatches": 2, "predicted_hit_tokens": 100, "served_hit_tokens": 90,
              "peer_hints": 1, "decision_mean_s": 0.5}
    now = {"requests": 30, "hit_mismatches": 3, "predicted_hit_tokens": 400, "served_hit_tokens": 390,
           "peer_hints": 1, "decision_mean_s": 0.25}
    assert since(now, before) == {"requests": 20, "hit_mismatches": 1, "predicted_hit_tokens": 300,
                                   "served_hit_tokens": 300, "peer_hints": 0, "decision_mean_s": 0.25}
    assert since(now, {}) == now


def test_the_simulated_shift_measures_the_second_phase_and_kv_aware_keeps_its_lead() -> None:
    from kvmesh.bench.routing import simulate_live_scenario
    from kvmesh.bench.routing_live import QUICK
    from router.routing.types import RoutingPolicy
    kv = [simulate_live_scenario(RoutingPolicy.KV_AWARE, QUICK, "shift", seed) for seed in range(2)]
    rr = [simulate_live_scenario(RoutingPolicy.ROUND_ROBIN, QUICK, "shift", seed) for seed in range(2)]
    # the second phase's prefixes are new: each is computed at least once
    assert all(r.cold_requests >= QUICK.pressure_prefixes for r in kv + rr)
    assert sum(r.hit_rate for r in kv) > sum(r.hit_rate for r in rr) + 2 * 0.05


@pytest.mark.slow
def test_tiny_live_run_through_real_clusters(tmp_path: Path) -> None:
    path = tmp_path / "live.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "routing-live", "--quick", "--scenarios", "no_pressure",
         "--policies", "round_robin,kv_aware", "--prefixes", "2", "--prefix-tokens", "64", "--question-tokens", "8",
         "--output-tokens", "4", "--requests", "8", "--concurrency", "4", "--json", str(path),
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(path.read_text())
    kept = sorted(p.name for p in (tmp_path / "logs").iterdir())   # --log-dir: a folder per cluster, kept
    assert len(kept) == 2 and all((tmp_path / "logs" / k / "router.log").exists() for k in kept)
    assert set(doc) - {"meta"} == {"no_pressure"} and set(doc["no_pressure"]) == {"round_robin", "kv_aware"}
    for entry in doc["no_pressure"].values():
        assert KEYS <= set(entry)
        assert sum(sum(v.values()) for v in entry["requests_per_worker_per_prefix"].values()) == 8
        assert entry["cold_requests"] >= entry["min_cold_requests"] == 2
        assert len(entry["diagnostics"]["load_avg"]) == 2       # the machine's load as the phase began and ended
        cpu = entry["diagnostics"]["cpu_s"]                      # each local process's CPU in the phase
        assert {"router", "redis", "worker-0", "worker-1"} <= set(cpu) and cpu["router"] > 0 and cpu["worker-0"] > 0
        # the router's pick log, classified: every measured request once
        picks = entry["diagnostics"]["pick_log"]
        assert sum(c["requests"] for c in picks.values()) == 8 and picks["cold"]["requests"] >= 2
        assert entry["diagnostics"]["peer_fetches"] >= 0     # the workers' GetLoad peer counters, read
        assert entry["diagnostics"]["preemptions"] >= 0      # and their preemptions
    # the pending prefix draws the followers: kv_aware computes no prefix more often than round robin
    kv, rr = doc["no_pressure"]["kv_aware"], doc["no_pressure"]["round_robin"]
    assert kv["cold_requests"] <= rr["cold_requests"] and 0.0 <= kv["mismatch_rate"] <= 1.0


def test_routers_flag_and_the_replica_comparison() -> None:
    from kvmesh.bench.routing_replicas import compare_replicas
    assert _args("--routers", "3").routers == 3 and _args().routers == 1
    with pytest.raises(CLIError, match="--routers"):
        _args("--routers", "0")
    calls: list[tuple[int, tuple[str, ...]]] = []

    def run(n: int, argv: tuple[str, ...]) -> dict[str, object]:
        calls.append((n, argv))
        shared = bool(argv)
        return {"cached_token_frac": 0.8 if n == 1 else 0.7 + 0.05 * shared, "cold_requests": 4 if n == 1 else 6,
                "mismatch_rate": 0.0 if n == 1 else 0.1, "router": {"prediction_error_sum": 2.0 * (n - 1),
                                                                    "prediction_error_count": 10}}
    out = compare_replicas(2, run)
    assert calls == [(1, ()), (2, ()), (2, ("--share-pending",))]
    assert out["replicas"]["prediction_error_mean"] == pytest.approx(0.2)
    assert out["gap"]["replicas"]["cached_token_frac"] == pytest.approx(-0.1)
    assert out["gap"]["replicas_shared"]["cached_token_frac"] == pytest.approx(-0.05)
    assert out["gap"]["replicas_shared"]["cold_requests"] == 2 and out["routers"] == 2


def test_repeats_alternate_the_order_and_combine_the_rounds() -> None:
    from kvmesh.bench.routing_repeats import MEDIAN_KEYS, rounds
    assert _args().repeats == 1 and _args("--repeats", "3").repeats == 3
    with pytest.raises(CLIError, match="--repeats"):
        _args("--repeats", "0")
    order: list[str] = []

    def run(policy: str) -> dict[str, object]:
        order.append(policy)
        n = len(order)
        return {**{k: float(n) for k in MEDIAN_KEYS}, "min_cold_requests": 2, "requests": 4,
                "requests_per_worker": {"w0": n, "w1": 4 - n if n < 4 else 0},
                "requests_per_worker_per_prefix": {"0": {"w0": 1}, str(n): {"w1": 1}},
                "mismatch_rate": 0.5, "router": {"hit_mismatches": n % 2, "requests": 4},
                "diagnostics": {"in_flight_imbalance": float(n), "load_avg": [n, n],
                                "cpu_s": {"router": float(n), "worker-0": 10.0 * n},
                                "pick_log": {c: {"requests": n, "ttft_p50_s": float(n) if c != "cold" else None}
                                             for c in PICK_CLASSES}}}
    one = rounds(("rr", "kv"), 1, run)
    assert order == ["rr", "kv"] and one["kv"]["cold_requests"] == 2.0 and "repeats" not in one["kv"]
    order.clear()
    done = rounds(("rr", "kv"), 3, run)
    assert order == ["rr", "kv", "kv", "rr", "rr", "kv"]        # every other round reversed
    kv = done["kv"]                                              # kv ran 2nd, 3rd and 6th
    assert kv["cold_requests"] == 3.0 and kv["req_s"] == 3.0     # medians
    assert kv["requests"] == 12 and kv["requests_per_worker"] == {"w0": 11, "w1": 3}
    assert kv["requests_per_worker_per_prefix"]["0"] == {"w0": 3}
    assert kv["router"]["hit_mismatches"] == 1 and kv["mismatch_rate"] == 1 / 12   # summed, not the median
    assert [r["load_avg"] for r in kv["repeats"]] == [[2, 2], [3, 3], [6, 6]]
    assert [r["cpu_s"]["router"] for r in kv["repeats"]] == [2.0, 3.0, 6.0]
    assert kv["diagnostics"]["cpu_s"] == {"router": 3.0, "worker-0": 30.0}    # each process's median
    assert kv["diagnostics"]["in_flight_imbalance"] == 3.0 and list(done) == ["rr", "kv"]
    assert kv["diagnostics"]["pick_log"]["warm_idle"] == {"requests": 11, "ttft_p50_s": 3.0}   # summed; median
    assert kv["diagnostics"]["pick_log"]["cold"] == {"requests": 11, "ttft_p50_s": None}


def _pick(rid: str, t: float, worker: str, queued: dict[str, int]) -> str:
    return json.dumps({"event": "pick", "t": t, "request_id": rid, "worker": worker,
                       "workers": {w: {"cached": 0, "queued_tokens": q} for w, q in queued.items()}})


def _finish(rid: str, cached: int, peer: int, ttft: float) -> str:
    return json.dumps({"event": "finish", "t": 0.0, "request_id": rid, "worker": "w0", "prompt_tokens": 80,
                       "cached_tokens": cached, "peer_cached_tokens": peer, "ttft_s": ttft})


def test_pick_log_figures_class_each_request_by_what_its_worker_held_and_had_queued() -> None:
    lines = [_pick("old", 5.0, "w0", {"w0": 0}), _finish("old", 0, 0, 9.0),       # before the phase: left out
             _pick("a", 10.0, "w0", {"w0": 0, "w1": 32}), _finish("a", 0, 0, 0.5),          # cold
             _pick("b", 11.0, "w1", {"w0": 0, "w1": 0}), _finish("b", 64, 64, 0.3),         # fetched from a peer
             _pick("c", 12.0, "w0", {"w0": 32, "w1": 0}),
             _pick("d", 12.5, "w1", {"w0": 32, "w1": 0}), _finish("d", 64, 0, 0.1),         # warm, none queued
             _finish("c", 64, 0, 0.2),                                                      # warm, one queued
             _pick("e", 13.0, "w0", {"w0": 0}), _pick("e", 14.0, "w1", {"w0": 0, "w1": 96}),   # resubmitted:
             _finish("e", 64, 0, 0.4),                                                      # its last pick counts
             _pick("f", 15.0, "w0", {"w0": 0}),                                             # never finished
             _finish("g", 64, 0, 0.1)[:30]]                       # a router killed mid-write: a cut line
    figures = pick_log_figures(lines, full_prefix=64, since=10.0)
    assert figures == {"cold": {"requests": 1, "ttft_p50_s": 0.5}, "peer_fetched": {"requests": 1, "ttft_p50_s": 0.3},
                       "warm_queued": {"requests": 2, "ttft_p50_s": pytest.approx(0.3)},
                       "warm_idle": {"requests": 1, "ttft_p50_s": 0.1}}
    assert pick_log_figures([], 64)["cold"] == {"requests": 0, "ttft_p50_s": None}


def test_cpu_seconds_reads_a_live_process_and_leaves_out_a_gone_one() -> None:
    import os
    before = cpu_seconds({"me": os.getpid()})["me"]
    sum(i * i for i in range(2_000_000))                       # some CPU of this process
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    after = cpu_seconds({"me": os.getpid(), "gone": int(gone.stdout)})
    assert set(after) == {"me"} and after["me"] > before


def test_worker_loads_asks_each_worker_and_the_benches_read_their_counters() -> None:
    import asyncio

    from kvmesh.bench.routing import _worker_counters
    from kvmesh.bench.routing_live_probes import WorkerCounters, counted_since, worker_counters, worker_loads
    from tests.support.fake_worker import FakeWorker

    Read = dict[str, WorkerCounters]

    async def go() -> tuple[list[str], list[tuple[int, int]], Read, Read, Read]:
        fakes = [FakeWorker("w0", num_preemptions=2), FakeWorker("w1", num_preemptions=5)]
        for f in fakes:
            await f.start()
        try:
            addresses = [f.address for f in fakes]
            ids = [load.worker_id for load in await worker_loads(addresses)]
            tokens = await _worker_counters(addresses)
            before = await worker_counters(addresses)
            fakes[0].num_preemptions = 6
            fakes[1].num_preemptions = 9
            now = await worker_counters(addresses)
            await fakes[1].stop()                    # killed in the phase: it no longer answers GetLoad
            fakes[0].num_preemptions = 7
            return ids, tokens, before, now, await worker_counters(addresses)
        finally:
            for f in fakes:
                await f.stop()                       # a stopped server's stop returns at once
    ids, counters, before, now, after_kill = asyncio.run(go())
    assert ids == ["w0", "w1"] and counters == [(0, 0), (0, 0)]
    assert counted_since(before, {}) == ((0, 0.0, 0), 2)
    total, unread = counted_since(before, {a: WorkerCounters(0, 0.0, 0) for a in before})
    assert total == (0, 0.0, 7) and unread == 0  # no peer plane reported: no fetches counted; preemptions summed
    assert counted_since(now, before) == ((0, 0.0, 8), 0)                        # 4 + 4 in the phase
    # the killed worker is left out of the reading and of the sum, and counted as unread
    assert len(after_kill) == 1 and counted_since(after_kill, before) == ((0, 0.0, 5), 1)
    assert WorkerCounters(5, 2.5, 3) - WorkerCounters(1, 0.5, 1) == (4, 2.0, 2)   # a phase's counts: after - before
